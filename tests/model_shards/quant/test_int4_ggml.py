"""4-bit groups as GGML blocks (``quant/int4_ggml.py``): Q4_0 exactly the symmetric weight, Q4_1
within its stated bound of the asymmetric one; and a fused layer's parts joined
(``quant/checkpoint_weight.py``) only where they agree."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from model_shards.quant.checkpoint_weight import CheckpointWeight
from model_shards.quant.formats import GGMLType
from model_shards.quant.fp8 import Fp8Weight, quantize_weight
from model_shards.quant.int4 import Int4GroupWeight
from model_shards.quant.int4_ggml import ggml_type_for, to_ggml


def _int4(n: int, k: int, group: int, asym: bool, seed: int = 0) -> Int4GroupWeight:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.uint8)
    scales = (torch.rand(n, k // group, generator=gen) * 0.05 + 1e-3).to(torch.float16)
    zeros = torch.randint(0, 16, (n, k // group), generator=gen, dtype=torch.uint8)
    return Int4GroupWeight(q, scales, zeros if asym else None, group)


def test_symmetric_groups_are_q4_0_exactly() -> None:
    w = _int4(16, 256, 64, asym=False)
    blocks = to_ggml(w)
    assert blocks is not None and blocks.qtype == GGMLType.Q4_0
    assert torch.equal(blocks.dequantize(), w.dequantize())
    # llama.cpp's own reader of the same bytes
    theirs = gguf.quants.dequantize(blocks.data.numpy(), gguf.GGMLQuantizationType.Q4_0)
    assert np.array_equal(theirs, w.dequantize().numpy())


def test_asymmetric_groups_are_q4_1_within_the_offset_rounding() -> None:
    w = _int4(16, 256, 32, asym=True, seed=1)
    blocks = to_ggml(w)
    assert blocks is not None and blocks.qtype == GGMLType.Q4_1
    err = (blocks.dequantize() - w.dequantize()).abs()  # [N, K]
    step = w.scales.float().repeat_interleave(32, dim=1)
    # |m16 - m| <= 2^-11 |zero * scale| (+ float32 rounding of the two products)
    bound = 2.0**-11 * w.zeros.float().repeat_interleave(32, dim=1) * step + 1e-7
    assert bool((err <= bound).all()), (err / step).max()
    assert (err / step).max() < 16 * 2.0**-11


@pytest.mark.parametrize(
    ("group", "g_idx", "scale"),
    [(16, False, 0.01), (64, True, 0.01), (64, False, 1e-6), (64, False, 0.01 + 1e-9)],
    ids=["group16", "act-order", "subnormal-scale", "float32-scale"],
)
def test_what_blocks_cannot_hold_stays_4_bit(group: int, g_idx: bool, scale: float) -> None:
    w = _int4(8, 128, group, asym=False)
    w.scales = torch.full(w.scales.shape, scale, dtype=torch.float32)
    if g_idx:
        w.g_idx = torch.randperm(128) // group
    assert ggml_type_for(w) is None and to_ggml(w) is None


def test_parts_join_where_they_agree() -> None:
    a, b = _int4(8, 64, 32, asym=True), _int4(4, 64, 32, asym=True, seed=2)
    held = CheckpointWeight(16, 64)
    held.add(8, b)
    held.add(0, a)
    assert [s for s, _ in held.parts] == [0] and not held.covers_all
    expected = torch.cat([a.dequantize(), b.dequantize(), torch.zeros(4, 64)])
    assert torch.equal(held.dequantize(), expected)
    held.add(12, _int4(4, 64, 32, asym=False))  # no zeros: a part of its own
    assert [s for s, _ in held.parts] == [0, 12] and held.covers_all
    with pytest.raises(ValueError, match="loaded twice"):
        held.add(10, _int4(4, 64, 32, asym=True))

    fp8 = CheckpointWeight(8, 32)
    static = [
        Fp8Weight(quantize_weight(torch.randn(4, 32)).weight, torch.ones(4), torch.tensor(s))
        for s in (0.5, 0.25)
    ]
    fp8.add(0, static[0])
    fp8.add(4, static[1])  # another input scale: another GEMM
    assert len(fp8.parts) == 2


def test_fp8_weight_quantization_is_per_channel() -> None:
    w = torch.randn(6, 40) * torch.logspace(-3, 1, 6)[:, None]
    w[2] = 0
    q = quantize_weight(w)
    assert torch.equal(q.scale[2], torch.tensor(1.0))
    assert torch.allclose(q.scale, torch.where(w.abs().amax(1) == 0, 1, w.abs().amax(1) / 448))
    rel = ((q.dequantize() - w).abs() / w.abs().amax(1, keepdim=True).clamp(min=1e-30)).max()
    assert rel <= 2.0**-4  # e4m3: 3 mantissa bits, half a step at the row's top binade
