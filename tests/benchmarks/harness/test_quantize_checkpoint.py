"""The bench's quantizer (``benchmarks/harness/quantize_checkpoint.py``): its FP8 and AWQ
checkpoints of the tiny Llama read back through the server's own config parser and
``QuantizedStore``, each weight within round-to-nearest of the dense one (FP8: half an e4m3
step of its channel; AWQ: half a step of its group), the rest of the checkpoint unchanged."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from benchmarks.harness.quantize_checkpoint import LINEARS, write_quantized
from model_shards.config.model import ModelConfig
from model_shards.config.quantization import CheckpointQuant
from model_shards.worker.checkpoint import Checkpoint
from model_shards.worker.quant_sources import QuantizedStore
from tests.checkpoints import build_tiny_llama

EXPECTED = {
    "fp8": CheckpointQuant("fp8", "compressed-tensors"),
    "awq": CheckpointQuant("awq", "awq", 32, symmetric=False),
}


@pytest.mark.parametrize("fmt", list(EXPECTED))
def test_quantized_checkpoint_reads_back_within_rounding(tmp_path: Path, fmt: str) -> None:
    dense = build_tiny_llama(tmp_path / "dense", sharded=False)
    out = write_quantized(dense, tmp_path / fmt, fmt, group_size=32)
    cfg = ModelConfig.from_dir(out)
    assert cfg.quant == EXPECTED[fmt]
    weights = load_file(str(dense / "model.safetensors"))
    with Checkpoint(out) as checkpoint:
        store = QuantizedStore(checkpoint, cfg.quant)
        assert set(store.names()) == set(weights)
        quantized = 0
        for name, w in weights.items():
            got = store.source(name).read()
            if name.removesuffix(".weight").rpartition(".")[2] not in LINEARS:
                assert torch.equal(got, w), name
                continue
            quantized += 1
            wf = w.float()
            if fmt == "fp8":  # e4m3: 3 mantissa bits, so within 2^-4 of |w| (or the subnormal step)
                step = wf.abs().amax(1, keepdim=True) / 448 * 2.0**-9
                bound = torch.maximum(wf.abs() * 2.0**-4, step)
            else:
                g = wf.view(wf.shape[0], -1, 32)
                span = g.amax(-1).clamp(min=0) - g.amin(-1).clamp(max=0)  # [N, K/32]
                bound = (span / 15 * 0.51 + 1e-3 * span.max()).repeat_interleave(32, dim=1)
            assert bool(((got - wf).abs() <= bound).all()), name
    assert quantized == 4 * len(LINEARS)
