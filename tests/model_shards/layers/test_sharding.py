"""Each TP layer's sharding on its own: the slices every rank loads reassemble the full
checkpoint weight (column: rows of ``W``; row: columns; merged gate/up and QKV: each part
split on its own, KV heads replicated when tp > nkv; vocab: padded row ranges)."""

from __future__ import annotations

import pytest
import torch

from model_shards.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from model_shards.layers.vocab import ParallelLMHead, VocabParallelEmbedding
from tests.model_shards.layers.sharding import FullTensor, shard_context


def _full(*shape: int) -> torch.Tensor:
    return torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_column_and_row_slices_reassemble(tp: int) -> None:
    w = _full(8, 12)  # [out, in]
    cols = []
    rows = []
    for r in range(tp):
        col = ColumnParallelLinear(12, 8, bias=False, ctx=shard_context(r, tp))
        col.weight_loader(col.weight, FullTensor("c", w))  # type: ignore[arg-type]
        cols.append(col.weight.data)
        row = RowParallelLinear(12, 8, bias=False, ctx=shard_context(r, tp))
        row.weight_loader(row.weight, FullTensor("r", w))  # type: ignore[arg-type]
        rows.append(row.weight.data)
    assert torch.equal(torch.cat(cols, 0), w)  # output features split
    assert torch.equal(torch.cat(rows, 1), w)  # input features split


@pytest.mark.parametrize("tp", [1, 2])
def test_merged_gate_up_each_part_split_on_its_own(tp: int) -> None:
    gate, up = _full(6, 4), _full(6, 4) + 1000
    for r in range(tp):
        layer = MergedColumnParallelLinear(4, [6, 6], bias=False, ctx=shard_context(r, tp))
        layer.weight_loader(layer.weight, FullTensor("g", gate), 0)  # type: ignore[arg-type]
        layer.weight_loader(layer.weight, FullTensor("u", up), 1)  # type: ignore[arg-type]
        local = 6 // tp
        want = torch.cat([gate[r * local : (r + 1) * local], up[r * local : (r + 1) * local]])
        assert torch.equal(layer.weight.data, want)


@pytest.mark.parametrize(("heads", "kv_heads", "tp"), [(4, 2, 2), (4, 1, 2), (6, 2, 2), (4, 2, 4)])
def test_qkv_heads_split_and_kv_heads_replicated(heads: int, kv_heads: int, tp: int) -> None:
    d, hidden = 2, 5
    q = _full(heads * d, hidden)
    k, v = _full(kv_heads * d, hidden) + 1e4, _full(kv_heads * d, hidden) + 2e4
    for r in range(tp):
        layer = QKVParallelLinear(hidden, d, heads, kv_heads, bias=False, ctx=shard_context(r, tp))
        for part, t in (("q", q), ("k", k), ("v", v)):
            layer.weight_loader(layer.weight, FullTensor(part, t), part)  # type: ignore[arg-type]
        nh, nkv = heads // tp, max(1, kv_heads // tp)
        kv_slot = r * kv_heads // tp if tp > kv_heads else r  # replicas share a KV head
        want = torch.cat(
            [
                q[r * nh * d : (r + 1) * nh * d],
                k[kv_slot * nkv * d : (kv_slot + 1) * nkv * d],
                v[kv_slot * nkv * d : (kv_slot + 1) * nkv * d],
            ]
        )
        assert torch.equal(layer.weight.data, want), r


@pytest.mark.parametrize("tp", [1, 2, 3])
def test_vocab_rows_padded_and_reassembled(tp: int) -> None:
    vocab, hidden = 10, 3
    table = _full(vocab, hidden) + 1
    parts = []
    for r in range(tp):
        for cls in (VocabParallelEmbedding, ParallelLMHead):
            layer = cls(vocab, hidden, shard_context(r, tp))
            layer.weight_loader(layer.weight, FullTensor("e", table))  # type: ignore[arg-type]
        parts.append(layer.weight.data)
    per_rank = -(-vocab // tp)
    full = torch.cat(parts)
    assert full.shape == (per_rank * tp, hidden)
    assert torch.equal(full[:vocab], table)
    assert not full[vocab:].any()  # padding rows stay zero
