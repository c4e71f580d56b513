"""The Conv1D loaders (GPT-2's ``[in, out]`` checkpoint tensors) give every rank exactly the
slice the ``nn.Linear``-layout layers give it from ``W = A^T``: column (``c_fc``), fused
Q/K/V by heads (``c_attn``, also with fewer KV heads), row (``c_proj``), biases included;
a tensor of the wrong shape is refused by name."""

from __future__ import annotations

import pytest
import torch

from model_shards.layers.conv1d import (
    Conv1DColumnParallelLinear,
    Conv1DQKVParallelLinear,
    Conv1DRowParallelLinear,
)
from model_shards.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from model_shards.worker.checkpoint import CheckpointError
from tests.model_shards.layers.sharding import FullTensor, shard_context


def _load(layer: torch.nn.Module, name: str, tensor: torch.Tensor, *shard: str) -> None:
    param = getattr(layer, name)
    param.weight_loader(param, FullTensor(f"x.{name}", tensor), *shard)


def _same(
    ours: ColumnParallelLinear | RowParallelLinear, want: ColumnParallelLinear | RowParallelLinear
) -> bool:
    assert ours.bias is not None and want.bias is not None
    return torch.equal(ours.weight, want.weight) and torch.equal(ours.bias, want.bias)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_column_and_row_match_the_linear_layout(tp: int) -> None:
    w, b = torch.randn(8, 12), torch.randn(8)  # nn.Linear layout [out, in]
    for r in range(tp):
        ours = Conv1DColumnParallelLinear(12, 8, bias=True, ctx=shard_context(r, tp))
        want = ColumnParallelLinear(12, 8, bias=True, ctx=shard_context(r, tp))
        _load(ours, "weight", w.t().contiguous())
        _load(ours, "bias", b)
        _load(want, "weight", w)
        _load(want, "bias", b)
        assert _same(ours, want)
        row = Conv1DRowParallelLinear(8, 12, bias=True, ctx=shard_context(r, tp))
        row_want = RowParallelLinear(8, 12, bias=True, ctx=shard_context(r, tp))
        w2, b2 = torch.randn(12, 8), torch.randn(12)
        _load(row, "weight", w2.t().contiguous())
        _load(row, "bias", b2)
        _load(row_want, "weight", w2)
        _load(row_want, "bias", b2)
        assert _same(row, row_want)


@pytest.mark.parametrize(("heads", "kv_heads", "tp"), [(4, 4, 2), (6, 6, 2), (4, 2, 2), (4, 1, 2)])
def test_fused_c_attn_splits_like_separate_q_k_v(heads: int, kv_heads: int, tp: int) -> None:
    d, hidden = 3, 5
    q, k, v = (torch.randn(n * d, hidden) for n in (heads, kv_heads, kv_heads))
    bq, bk, bv = (torch.randn(n * d) for n in (heads, kv_heads, kv_heads))
    fused_w = torch.cat([q, k, v]).t().contiguous()  # Conv1D [H, (nh + 2 nkv) D]
    fused_b = torch.cat([bq, bk, bv])
    for r in range(tp):
        ours = Conv1DQKVParallelLinear(
            hidden, d, heads, kv_heads, bias=True, ctx=shard_context(r, tp)
        )
        _load(ours, "weight", fused_w)
        _load(ours, "bias", fused_b)
        want = QKVParallelLinear(hidden, d, heads, kv_heads, bias=True, ctx=shard_context(r, tp))
        for part, wt, bt in (("q", q, bq), ("k", k, bk), ("v", v, bv)):
            _load(want, "weight", wt, part)
            _load(want, "bias", bt, part)
        assert _same(ours, want)


def test_a_wrong_shape_names_the_tensor() -> None:
    layer = Conv1DQKVParallelLinear(5, 3, 4, 4, bias=True, ctx=shard_context(0, 2))
    with pytest.raises(CheckpointError, match=r"x\.weight"):
        _load(layer, "weight", torch.randn(5, 35))  # 35 != 3 * 4 * 3 columns
    mlp = Conv1DColumnParallelLinear(12, 8, bias=True, ctx=shard_context(0, 2))
    with pytest.raises(CheckpointError, match=r"x\.weight"):
        _load(mlp, "weight", torch.randn(8, 12))  # nn.Linear layout, not Conv1D's
