"""RMSNorm with a residual, the way the last stage's final norm now runs
(``LayerStack.finish``): the same bits as the separate add, then the norm, on the backends
that run on CPU (the cuda backend's kernel: ``backends/cuda/test_triton_fusions.py``)."""

from __future__ import annotations

import pytest
import torch

from model_shards.backends import Backend, ReferenceBackend
from model_shards.backends.cpu.backend import CpuBackend
from model_shards.backends.cpu.build import build_and_load
from model_shards.layers.context import ShardContext
from model_shards.layers.norm import RMSNorm


def _backend(name: str) -> Backend:
    if name == "cpu":
        assert build_and_load()
        return CpuBackend()
    return ReferenceBackend()


@pytest.mark.parametrize("name", ["reference", "cpu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_residual_add_has_the_bits_of_the_add_then_the_norm(
    name: str, dtype: torch.dtype
) -> None:
    gen = torch.Generator().manual_seed(3)
    norm = RMSNorm(96, 1e-5, ShardContext.single_process(_backend(name), dtype))
    norm.weight.data.copy_(1 + 0.3 * torch.randn(96, generator=gen))
    x = (4 * torch.randn(7, 96, generator=gen)).to(dtype)
    residual = (4 * torch.randn(7, 96, generator=gen)).to(dtype)
    fused, total = norm(x, residual.clone())
    separate, _ = norm(x + residual)
    assert torch.equal(total, x + residual)
    assert torch.equal(fused, separate)
