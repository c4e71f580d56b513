"""Row panels (model_shards/quant/panels.py) and the holders' view of them (quant/weights.py):
the layout is a byte permutation (exact round trip, fields where the kernel reads them), and a
weight laid out as panels dequantizes, looks rows up and refuses layouts exactly as before."""

from __future__ import annotations

import pytest
import torch

from model_shards.quant.formats import BLOCK_SIZES, GGMLType
from model_shards.quant.panels import PANEL_ROWS, PANEL_TYPES, from_panels, to_panels
from model_shards.quant.weights import QuantizedTensor, QuantizedWeight
from tests.model_shards.layers.sharding import random_blocks

TYPES = sorted(PANEL_TYPES)


def _cols(qtype: GGMLType) -> int:
    return 512 if qtype >= GGMLType.Q4_K else 96


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_round_trip_is_exact_and_every_byte_moves_once(qtype: GGMLType) -> None:
    blocks = random_blocks(qtype, 48, _cols(qtype), seed=int(qtype))
    panels = to_panels(blocks, qtype)
    assert panels.shape == blocks.shape and not torch.equal(panels, blocks)
    assert torch.equal(from_panels(panels, qtype), blocks)
    # a permutation: distinct byte positions stay distinct (position ids through the layout)
    ids = torch.arange(blocks.numel(), dtype=torch.int64)
    size = BLOCK_SIZES[qtype][1]
    as_bytes = torch.stack([(ids >> (8 * i)) & 0xFF for i in range(3)])  # 3 bytes of each id
    moved = [to_panels(b.to(torch.uint8).view(blocks.shape), qtype) for b in as_bytes]
    back = sum(m.to(torch.int64) << (8 * i) for i, m in enumerate(moved)).flatten()
    assert back.unique().numel() == blocks.numel() and back.numel() % (PANEL_ROWS * size) == 0


def test_q4_1_panel_block_holds_the_rows_scales_then_four_quant_bytes_per_row() -> None:
    blocks = random_blocks(GGMLType.Q4_1, 16, 32, seed=1)  # one block per row: 20 bytes
    panel = to_panels(blocks, GGMLType.Q4_1).reshape(-1)  # the group's 320 bytes
    assert torch.equal(panel[:32].view(16, 2), blocks[:, 0:2])  # d of rows 0..15
    assert torch.equal(panel[32:64].view(16, 2), blocks[:, 2:4])  # m
    for g in range(4):  # qs bytes 4g..4g+3 of each row
        part = panel[64 + 64 * g : 128 + 64 * g].view(16, 4)
        assert torch.equal(part, blocks[:, 4 + 4 * g : 8 + 4 * g])


def test_rows_not_in_sixteens_and_float_types_have_no_panels() -> None:
    with pytest.raises(ValueError, match="sixteens"):
        to_panels(random_blocks(GGMLType.Q8_0, 24, 64), GGMLType.Q8_0)
    with pytest.raises(ValueError, match="no row-panel layout"):
        QuantizedTensor(GGMLType.Q8_0, random_blocks(GGMLType.Q8_0, 24, 64), 64, panels=True)
    dense = torch.randn(16, 64)
    weight = QuantizedWeight(out_features=60, in_features=64)
    weight.add(0, QuantizedTensor(GGMLType.Q4_0, random_blocks(GGMLType.Q4_0, 36, 64, 2), 64))
    weight.add(36, QuantizedTensor(GGMLType.Q8_0, random_blocks(GGMLType.Q8_0, 8, 64, 3), 64))
    weight.add(44, QuantizedTensor(GGMLType.F32, dense.view(torch.uint8).reshape(16, -1), 64))
    want = weight.dequantize()
    assert weight.to_panels(PANEL_TYPES)
    layout = [(s.start, s.tensor.rows, s.tensor.panels) for s in weight.segments]
    assert layout == [(0, 32, True), (32, 4, False), (36, 8, False), (44, 16, False)]
    assert torch.equal(weight.dequantize(), want)
    assert not weight.to_panels(PANEL_TYPES)  # nothing left to lay out


@pytest.mark.parametrize("qtype", [GGMLType.Q8_0, GGMLType.Q6_K], ids=lambda t: t.name)
def test_a_weight_in_panels_dequantizes_and_looks_rows_up_as_before(qtype: GGMLType) -> None:
    k = _cols(qtype)
    weight = QuantizedWeight(out_features=40, in_features=k)  # rows 32..39: padding
    weight.add(0, QuantizedTensor(qtype, random_blocks(qtype, 32, k, seed=4), k))
    ids = torch.tensor([31, 0, 17, 17, 35, 16])
    dense, rows = weight.dequantize(), weight.take_rows(ids)
    assert weight.to_panels(frozenset({qtype}))
    assert torch.equal(weight.dequantize(), dense)
    assert torch.equal(weight.take_rows(ids), rows)
    assert torch.equal(rows[4], torch.zeros(k))
