"""Layers holding quantized weights (layers/loading.py): GGUF blocks kept as they are, per-part
segments of mixed types in fused layers, TP splits on block boundaries, the vocab table and a
tied head, ``--quantization`` at load, and a backend that keeps no block types (cuda's)."""

from __future__ import annotations

import pytest
import torch

from model_shards.backends import ReferenceBackend
from model_shards.layers.fused_sources import FusedMergedColumnParallelLinear
from model_shards.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from model_shards.layers.loading import keep_dense, quant_of
from model_shards.layers.vocab import ParallelLMHead, VocabParallelEmbedding
from model_shards.quant.formats import GGMLType
from model_shards.quant.quantize import quantize
from model_shards.worker.checkpoint import CheckpointError
from tests.model_shards.layers.sharding import (
    BlockTensor,
    FullTensor,
    random_blocks,
    shard_context,
)


def _source(name: str, qtype: GGMLType, rows: int, cols: int, seed: int) -> BlockTensor:
    return BlockTensor(name, random_blocks(qtype, rows, cols, seed), qtype, cols)


class DenseOnly(ReferenceBackend):
    """Keeps no block type, as the cuda backend."""

    def quantized_types(self) -> frozenset[GGMLType]:
        return frozenset()


@pytest.mark.parametrize("tp", [1, 2])
def test_qkv_parts_of_mixed_types_are_segments(tp: int) -> None:
    hidden, d = 256, 32
    parts = {
        "q": _source("q", GGMLType.Q4_K, 4 * d, hidden, 1),
        "k": _source("k", GGMLType.Q4_K, 2 * d, hidden, 2),
        "v": _source("v", GGMLType.Q6_K, 2 * d, hidden, 3),
    }
    x = torch.randn(3, hidden)
    for r in range(tp):
        layer = QKVParallelLinear(hidden, d, 4, 2, bias=False, ctx=shard_context(r, tp))
        dense = QKVParallelLinear(hidden, d, 4, 2, bias=False, ctx=shard_context(r, tp))
        for name, src in parts.items():
            layer.weight_loader(layer.weight, src, name)
            dense.weight_loader(dense.weight, FullTensor(name, src.tensor), name)  # type: ignore[arg-type]
        held = quant_of(layer.weight)
        assert held is not None and layer.weight.numel() == 0  # no dense copy kept
        local = 4 * d // tp
        assert [(s.start, s.tensor.qtype) for s in held.segments] == [
            (0, GGMLType.Q4_K),  # q and k merged: adjacent rows of one type
            (local + 2 * d // tp, GGMLType.Q6_K),
        ]
        assert held.nbytes == (local + 2 * d // tp) * 144 + 2 * d // tp * 210
        assert torch.equal(held.dequantize(), dense.weight.data)
        torch.testing.assert_close(layer(x), dense(x))


def test_qkv_parts_in_file_order_are_one_segment() -> None:
    """A GGUF file lists attn_k, attn_q, attn_v: parts of one type still make one GEMM."""
    hidden, d = 64, 32
    parts = {
        n: _source(n, GGMLType.Q4_1, r * d, hidden, i)
        for i, (n, r) in enumerate((("k", 2), ("q", 4), ("v", 2)))
    }
    layer = QKVParallelLinear(hidden, d, 4, 2, bias=False, ctx=shard_context(0, 1))
    for name, src in parts.items():
        layer.weight_loader(layer.weight, src, name)
    held = quant_of(layer.weight)
    assert held is not None and [(s.start, s.end) for s in held.segments] == [(0, 8 * d)]
    want = torch.cat([parts[n].blocks for n in ("q", "k", "v")])
    assert torch.equal(held.segments[0].tensor.data, want)


def test_merged_and_replicated_keep_blocks() -> None:
    gate = _source("g", GGMLType.Q5_0, 64, 128, 4)
    up = _source("u", GGMLType.Q5_1, 64, 128, 5)
    layer = MergedColumnParallelLinear(128, [64, 64], bias=False, ctx=shard_context(1, 2))
    layer.weight_loader(layer.weight, gate, 0)
    layer.weight_loader(layer.weight, up, 1)
    held = quant_of(layer.weight)
    assert held is not None and held.covers_all
    want = torch.cat([gate.tensor[32:], up.tensor[32:]])
    assert torch.equal(held.dequantize(), want)
    rep = ReplicatedLinear(128, 64, bias=True, ctx=shard_context(0, 1))
    rep.weight_loader(rep.weight, _source("w", GGMLType.Q4_1, 64, 128, 6))
    rep.weight_loader(rep.bias, FullTensor("b", torch.randn(64)))  # type: ignore[arg-type]
    x = torch.randn(2, 128)
    w = quant_of(rep.weight)
    assert w is not None
    assert rep.bias is not None
    torch.testing.assert_close(rep(x), x @ w.dequantize().T + rep.bias)


def test_row_parallel_splits_only_on_block_boundaries() -> None:
    src = _source("down", GGMLType.Q4_K, 8, 512, 7)
    pieces = []
    for r in range(2):  # 256 columns per rank: one Q4_K block each
        layer = RowParallelLinear(512, 8, bias=False, ctx=shard_context(r, 2))
        layer.weight_loader(layer.weight, src)
        held = quant_of(layer.weight)
        assert held is not None
        pieces.append(held.dequantize())
    assert torch.equal(torch.cat(pieces, 1), src.tensor)
    layer = RowParallelLinear(512, 8, bias=False, ctx=shard_context(1, 4))
    with pytest.raises(CheckpointError, match=r"split at columns 128:256.*\[1, 2\]"):
        layer.weight_loader(layer.weight, src)


@pytest.mark.parametrize(("qtype", "tp"), [(GGMLType.Q8_0, 1), (GGMLType.Q6_K, 3)])
def test_tied_vocab_table_and_head(qtype: GGMLType, tp: int) -> None:
    vocab, hidden = 10, 256
    src = _source("embd", qtype, vocab, hidden, 8)
    ids = torch.tensor([9, 0, 4, 4])
    hidden_states = torch.randn(2, hidden)
    for r in range(tp):
        ctx = shard_context(r, tp)
        emb = VocabParallelEmbedding(vocab, hidden, ctx)
        head = ParallelLMHead(vocab, hidden, ctx)
        head.weight = emb.weight  # tied: one parameter, held once
        emb.weight_loader(emb.weight, src)
        held = quant_of(head.weight)
        assert held is not None
        table = held.dequantize()
        lo = r * emb.per_rank
        rows = min(vocab, lo + emb.per_rank) - lo
        assert torch.equal(table[:rows], src.tensor[lo : lo + rows])
        assert not table[rows:].any()  # padding rows: zero
        local = torch.clamp(ids - lo, 0, emb.per_rank - 1)
        assert torch.equal(emb.lookup(local), table[local])
        torch.testing.assert_close(head.gemm(hidden_states), hidden_states @ table.T)


@pytest.mark.parametrize("method", ["q8_0", "q4_0"])
def test_quantization_flag_quantizes_dense_slices_at_load(method: str) -> None:
    w = torch.randn(64, 128)
    qtype = GGMLType.Q8_0 if method == "q8_0" else GGMLType.Q4_0
    for r in range(2):
        layer = RowParallelLinear(128, 64, bias=False, ctx=shard_context(r, 2, quantization=method))
        layer.weight_loader(layer.weight, FullTensor("w", w))  # type: ignore[arg-type]
        held = quant_of(layer.weight)
        assert held is not None and layer.weight.numel() == 0
        [segment] = held.segments
        assert segment.tensor.qtype == qtype
        assert torch.equal(segment.tensor.data, quantize(w[:, r * 64 : (r + 1) * 64], qtype))
    odd = ReplicatedLinear(40, 8, bias=False, ctx=shard_context(0, 1, quantization=method))
    odd.weight_loader(odd.weight, FullTensor("odd", torch.randn(8, 40)))  # type: ignore[arg-type]
    assert quant_of(odd.weight) is None  # 40 columns are no whole blocks: stays dense


def test_backend_without_block_types_dequantizes_at_load() -> None:
    src = _source("w", GGMLType.Q4_K, 16, 256, 9)
    layer = ReplicatedLinear(256, 16, bias=False, ctx=shard_context(0, 1, ops=DenseOnly()))
    layer.weight_loader(layer.weight, src)
    assert quant_of(layer.weight) is None
    assert torch.equal(layer.weight.data, src.tensor)


def test_keep_dense_parameters_take_no_blocks() -> None:
    src = _source("kv_b", GGMLType.Q8_0, 16, 64, 10)
    layer = ReplicatedLinear(64, 16, bias=False, ctx=shard_context(0, 1, quantization="q4_0"))
    keep_dense(layer.weight)  # as DeepSeek's kv_b_proj, whose forward reads the matrix
    layer.weight_loader(layer.weight, src)
    assert quant_of(layer.weight) is None
    assert torch.equal(layer.weight.data, src.tensor)


def test_fused_gguf_tensor_parts_keep_their_blocks() -> None:
    gate_up = _source("gate_up", GGMLType.Q4_0, 128, 64, 11)  # [gate; up], 64 rows each
    layer = FusedMergedColumnParallelLinear(64, [64, 64], bias=False, ctx=shard_context(1, 2))
    layer.weight_loader(layer.weight, gate_up)
    held = quant_of(layer.weight)
    assert held is not None and held.segments[0].tensor.qtype == GGMLType.Q4_0
    want = torch.cat([gate_up.tensor[32:64], gate_up.tensor[96:]])  # rank 1's half of each
    assert torch.equal(held.dequantize(), want)
