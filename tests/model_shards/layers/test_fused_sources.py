"""Fused checkpoint tensors (Phi-3's ``qkv_proj`` and ``gate_up_proj``): every rank loads
exactly what the split layers load from separate q/k/v (gate/up) tensors, reading only
its own rows of each part from the safetensors file."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from model_shards.layers.fused_sources import (
    FusedMergedColumnParallelLinear,
    FusedPart,
    FusedQKVParallelLinear,
)
from model_shards.layers.linear import MergedColumnParallelLinear, QKVParallelLinear
from model_shards.layers.loading import quant_of
from model_shards.layers.rotary import rotary_head_order
from model_shards.quant.formats import GGMLType
from model_shards.worker.checkpoint import Checkpoint, CheckpointError
from tests.model_shards.layers.sharding import BlockTensor, FullTensor, random_blocks, shard_context

HIDDEN = 5


def _checkpoint(tmp_path: Path, name: str, tensor: torch.Tensor) -> Checkpoint:
    save_file({name: tensor.contiguous()}, str(tmp_path / "model.safetensors"))
    return Checkpoint(tmp_path)


@pytest.mark.parametrize(("heads", "kv_heads", "tp"), [(6, 2, 1), (6, 2, 2), (4, 1, 2), (4, 2, 4)])
def test_fused_qkv_reads_only_this_ranks_rows(
    tmp_path: Path, heads: int, kv_heads: int, tp: int
) -> None:
    d = 4
    q, k, v = (torch.randn(n * d, HIDDEN) for n in (heads, kv_heads, kv_heads))
    with _checkpoint(tmp_path, "qkv", torch.cat((q, k, v))) as ckpt:
        for r in range(tp):
            fused = FusedQKVParallelLinear(
                HIDDEN, d, heads, kv_heads, bias=False, ctx=shard_context(r, tp)
            )
            split = QKVParallelLinear(
                HIDDEN, d, heads, kv_heads, bias=False, ctx=shard_context(r, tp)
            )
            for shard_id, part in (("q", q), ("k", k), ("v", v)):
                split.weight_loader(split.weight, FullTensor(shard_id, part), shard_id)  # type: ignore[arg-type]
            before = ckpt.bytes_read
            fused.weight_loader(fused.weight, ckpt.source("qkv"))
            assert torch.equal(fused.weight.data, split.weight.data)
            assert ckpt.bytes_read - before == fused.weight.numel() * 4  # its rows, no more


def test_fused_qkv_stores_q_and_k_heads_in_rotary_order(tmp_path: Path) -> None:
    heads, kv_heads, d, tp = 4, 2, 8, 2
    q, k, v = (torch.randn(n * d, HIDDEN) for n in (heads, kv_heads, kv_heads))
    order = rotary_head_order(d, 4)
    with _checkpoint(tmp_path, "qkv", torch.cat((q, k, v))) as ckpt:
        for r in range(tp):
            fused = FusedQKVParallelLinear(
                HIDDEN, d, heads, kv_heads, bias=False, ctx=shard_context(r, tp), head_order=order
            )
            fused.weight_loader(fused.weight, ckpt.source("qkv"))
            plain = FusedQKVParallelLinear(
                HIDDEN, d, heads, kv_heads, bias=False, ctx=shard_context(r, tp)
            )
            plain.weight_loader(plain.weight, ckpt.source("qkv"))
            qk_heads = (heads + kv_heads) // tp
            want = plain.weight.data.clone()
            want[: qk_heads * d] = (
                want[: qk_heads * d]
                .view(qk_heads, d, HIDDEN)[:, order]
                .reshape(qk_heads * d, HIDDEN)
            )
            assert torch.equal(fused.weight.data, want)  # v rows (the rest) unchanged
            assert not torch.equal(fused.weight.data, plain.weight.data)


@pytest.mark.parametrize("tp", [1, 2])
def test_a_quantized_fused_qkv_is_reordered_as_blocks(tp: int) -> None:
    """A GGUF qkv (Phi-4-mini's partial rotary): the rows move as whole rows of blocks, held
    quantized, and the layer computes what the dense reordered layer computes."""
    heads, kv_heads, d, k = 4, 2, 8, 64
    fused_rows = (heads + 2 * kv_heads) * d
    blocks = random_blocks(GGMLType.Q8_0, fused_rows, k, seed=3)
    source = BlockTensor("qkv", blocks, GGMLType.Q8_0, k)
    order = rotary_head_order(d, 4)
    x = torch.randn(3, k)
    for r in range(tp):
        layers = [
            FusedQKVParallelLinear(
                k, d, heads, kv_heads, bias=False, ctx=shard_context(r, tp), head_order=order
            )
            for _ in range(2)
        ]
        layers[0].weight_loader(layers[0].weight, source)
        layers[1].weight_loader(layers[1].weight, FullTensor("qkv", source.read()))
        held = quant_of(layers[0].weight)
        assert held is not None and quant_of(layers[1].weight) is None
        assert torch.equal(held.dequantize(), layers[1].weight.data)
        torch.testing.assert_close(layers[0](x), layers[1](x))


@pytest.mark.parametrize("tp", [1, 2])
def test_fused_gate_up_reads_only_this_ranks_rows(tmp_path: Path, tp: int) -> None:
    inter = 6
    gate, up = torch.randn(inter, HIDDEN), torch.randn(inter, HIDDEN)
    with _checkpoint(tmp_path, "gate_up", torch.cat((gate, up))) as ckpt:
        for r in range(tp):
            fused = FusedMergedColumnParallelLinear(
                HIDDEN, [inter, inter], bias=False, ctx=shard_context(r, tp)
            )
            split = MergedColumnParallelLinear(
                HIDDEN, [inter, inter], bias=False, ctx=shard_context(r, tp)
            )
            split.weight_loader(split.weight, FullTensor("g", gate), 0)  # type: ignore[arg-type]
            split.weight_loader(split.weight, FullTensor("u", up), 1)  # type: ignore[arg-type]
            before = ckpt.bytes_read
            fused.weight_loader(fused.weight, ckpt.source("gate_up"))
            assert torch.equal(fused.weight.data, split.weight.data)
            assert ckpt.bytes_read - before == fused.weight.numel() * 4


def test_fused_tensor_of_the_wrong_size_is_refused_by_name(tmp_path: Path) -> None:
    with _checkpoint(tmp_path, "model.layers.0.mlp.gate_up_proj.weight", torch.zeros(11, 5)) as c:
        layer = FusedMergedColumnParallelLinear(HIDDEN, [6, 6], bias=False, ctx=shard_context(0, 1))
        with pytest.raises(CheckpointError, match=r"gate_up_proj\.weight.*dim 0 == 12"):
            layer.weight_loader(layer.weight, c.source("model.layers.0.mlp.gate_up_proj.weight"))
        part = FusedPart(c.source("model.layers.0.mlp.gate_up_proj.weight"), 6, 5)
        assert part.name.endswith("gate_up_proj.weight[6:11]") and part.shape == (5, 5)
        with pytest.raises(CheckpointError, match=r"\[6:11\]"):
            part.read(0, 0, 6)
