"""The TP-sharded RMSNorm (OLMo 2's QK-norm) against Hugging Face's unsharded
``Olmo2RMSNorm``: at tp=1 bitwise; in a gloo world of 2 with the heads split (3 + 3,
1 + 1) and with one head replicated on both ranks (counted once, not twice)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm

from model_shards.backends import ReferenceBackend
from model_shards.layers.context import ShardContext
from model_shards.layers.sharded_norm import ShardedRMSNorm
from model_shards.parallel.comm import Comm
from model_shards.parallel.state import single_process_state
from model_shards.worker.checkpoint import CheckpointError
from tests.model_shards.layers.sharding import FullTensor
from tests.world import run_world

EPS = 1e-6
HEAD_DIM = 10


def _case(n_heads: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A full input ``[T, n_heads * D]`` (rows of very different scales) and weight."""
    gen = torch.Generator().manual_seed(seed)
    n = n_heads * HEAD_DIM
    x = torch.randn(5, n, generator=gen) * torch.tensor([[1e-3], [0.1], [1.0], [10.0], [1e3]])
    w = 1 + 0.1 * torch.randn(n, generator=gen)
    return x.to(dtype), w.to(dtype)


def _hf(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    ref = Olmo2RMSNorm(x.shape[-1], EPS).to(x.dtype)
    with torch.no_grad():
        ref.weight.copy_(w)
        return ref(x)


def _loaded(n_heads: int, w: torch.Tensor, ctx: ShardContext) -> ShardedRMSNorm:
    norm = ShardedRMSNorm(n_heads, HEAD_DIM, EPS, ctx)
    norm.weight_loader(norm.weight, FullTensor("q_norm.weight", w))  # type: ignore[arg-type]
    return norm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_unsharded_is_hugging_face_bitwise(dtype: torch.dtype) -> None:
    x, w = _case(6, dtype, seed=0)
    norm = _loaded(6, w, ShardContext.single_process(ReferenceBackend(), dtype))
    y = norm(x)
    assert y.dtype == dtype
    assert torch.equal(y, _hf(x, w))


def test_heads_that_cannot_be_split_and_wrong_sizes_are_refused() -> None:
    ps = replace(single_process_state(), tp_rank=0, tp_size=2)
    ctx = ShardContext(Comm(ps), ReferenceBackend(), torch.float32)
    with pytest.raises(ValueError, match="3 heads cannot be split over tp=2"):
        ShardedRMSNorm(3, HEAD_DIM, EPS, ctx)
    norm = ShardedRMSNorm(2, HEAD_DIM, EPS, ctx)
    too_long = FullTensor("k_norm.weight", torch.ones(3 * HEAD_DIM))
    with pytest.raises(CheckpointError, match=r"k_norm\.weight"):
        norm.weight_loader(norm.weight, too_long)  # type: ignore[arg-type]


def _sharded_rank(peers: Comm) -> None:
    ps = peers.ps
    for n_heads in (6, 2, 1):  # 3 + 3 heads, 1 + 1, one head on both ranks
        for dtype in (torch.float32, torch.bfloat16):
            x, w = _case(n_heads, dtype, seed=n_heads)
            norm = _loaded(n_heads, w, ShardContext(peers, ReferenceBackend(), dtype))
            cols = norm.local_size
            start = (ps.tp_rank if n_heads >= ps.tp_size else 0) * cols
            y = norm(x[:, start : start + cols].contiguous())
            want = _hf(x, w)[:, start : start + cols]
            assert y.dtype == dtype
            if dtype == torch.float32:
                torch.testing.assert_close(y, want, rtol=1e-6, atol=0)
            else:  # the partial sums add in another order: at most one bf16 rounding apart
                torch.testing.assert_close(y.float(), want.float(), rtol=2**-7, atol=0)


@pytest.mark.timeout(90)
def test_sharded_matches_unsharded_in_a_world_of_two() -> None:
    run_world(_sharded_rank, 2, 1, timeout=75)
