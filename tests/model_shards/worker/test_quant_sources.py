"""Each quantized layout unpacked (``worker/quant_sources.py``) against the values the test's own
packers (``tests/model_shards/quant_checkpoints.py``, written from each format's documented
layout) put in, whole and in tensor-parallel slices; compressed-tensors' against the
``compressed-tensors`` library's own decompression."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from model_shards.config.quantization import parse_quantization_config
from model_shards.quant.fp8 import Fp8Weight
from model_shards.quant.int4 import Int4GroupWeight
from model_shards.worker.checkpoint import Checkpoint, CheckpointError
from model_shards.worker.quant_sources import QuantizedStore, QuantSource
from tests.model_shards.quant_checkpoints import SPECS, fp8_tensors, int4_tensors

N, K = 48, 128
NAME = "model.layers.0.mlp.down_proj.weight"


def _store(tmp_path: Path, spec_name: str) -> tuple[QuantizedStore, torch.Tensor, dict]:
    """A checkpoint of one ``[N, K]`` weight (and a dense bias) in ``spec_name``'s layout; the
    store, the weight's values and the stored tensors."""
    spec = SPECS[spec_name]
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(N, K, generator=gen) * 0.1
    make = fp8_tensors if spec.layout in ("ct-fp8", "fbgemm") else int4_tensors
    tensors, held, _ = make(NAME, w, spec, gen)
    tensors["model.norm.weight"] = torch.ones(K)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    quant = parse_quantization_config({"quantization_config": spec.config}, "config.json")
    assert quant is not None
    return QuantizedStore(Checkpoint(tmp_path), quant), held, tensors


@pytest.mark.parametrize("name", list(SPECS))
def test_unpacked_values_and_slices(tmp_path: Path, name: str) -> None:
    store, held, _ = _store(tmp_path, name)
    assert sorted(store.names()) == ["model.layers.0.mlp.down_proj.weight", "model.norm.weight"]
    source = store.source(NAME)
    assert isinstance(source, QuantSource) and source.shape == (N, K)
    whole = source.read_quantized()
    kind = Fp8Weight if SPECS[name].layout in ("ct-fp8", "fbgemm") else Int4GroupWeight
    assert isinstance(whole, kind)
    assert torch.equal(whole.dequantize(), held)
    for rows in ((0, 24), (24, 48), (8, 40)):  # column parallel (AWQ's words: 8 columns)
        assert torch.equal(source.read_quantized(0, *rows).dequantize(), held[rows[0] : rows[1]])
    for cols in ((0, 64), (64, 128), (32, 96)):  # row parallel, on group boundaries
        part = source.read_quantized(1, *cols).dequantize()
        assert torch.equal(part, held[:, cols[0] : cols[1]]), cols
    assert torch.equal(source.read(1, 64, 128), held[:, 64:])  # dense modules


@pytest.mark.parametrize(
    ("name", "symmetric"), [("gptq", True), ("ct-w4a16", True), ("awq", False)]
)
def test_symmetric_weights_drop_their_zeros(tmp_path: Path, name: str, symmetric: bool) -> None:
    store, _, _ = _store(tmp_path, name)
    w = store.source(NAME).read_quantized()
    assert isinstance(w, Int4GroupWeight) and (w.zeros is None) == symmetric


def test_act_order_keeps_every_group_on_a_row_split(tmp_path: Path) -> None:
    store, held, tensors = _store(tmp_path, "gptq-actorder")
    w = store.source(NAME).read_quantized(1, 40, 72)  # not on a group boundary: act-order may
    assert isinstance(w, Int4GroupWeight) and w.g_idx is not None
    assert w.scales.shape == (N, K // 16)  # all groups, indexed by the slice's g_idx
    g_idx = tensors[NAME.removesuffix("weight") + "g_idx"]
    assert torch.equal(w.g_idx, g_idx[40:72].long())
    assert torch.equal(w.dequantize(), held[:, 40:72])


def test_row_split_off_group_boundaries_names_valid_sizes(tmp_path: Path) -> None:
    store, _, _ = _store(tmp_path, "awq")  # groups of 32 over K = 128
    with pytest.raises(CheckpointError, match=r"down_proj.*\[1, 2, 4\]"):
        store.source(NAME).read_quantized(1, 0, 48)


def test_missing_companion_tensor(tmp_path: Path) -> None:
    _, _, tensors = _store(tmp_path, "gptq")
    del tensors[NAME.removesuffix("weight") + "scales"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    quant = parse_quantization_config({"quantization_config": SPECS["gptq"].config}, "c")
    assert quant is not None
    with pytest.raises(CheckpointError, match=r"down_proj\.scales"):
        QuantizedStore(Checkpoint(tmp_path), quant)


@pytest.mark.parametrize("name", ["ct-w4a16", "ct-w4a16-asym", "ct-fp8-dynamic", "ct-fp8-static"])
def test_compressed_tensors_library_decompresses_the_same(tmp_path: Path, name: str) -> None:
    from tests.model_shards.worker.ct_library import decompress

    store, held, tensors = _store(tmp_path, name)
    prefix = NAME.removesuffix("weight")
    parts = {k.removeprefix(prefix): v for k, v in tensors.items() if k.startswith(prefix)}
    theirs = decompress(SPECS[name].config, parts)
    ours = store.source(NAME).read_quantized().dequantize()
    assert torch.equal(ours, theirs.float())
    assert torch.equal(ours, held)
