"""The sparse MoE kernels (:mod:`model_shards.backends.cuda.triton_ops.fused_moe`) against the
reference backend in Triton's interpreter: Mixtral-, Qwen-MoE- and DeepSeek-V2-style
routing (top-k 2, 4, 6; group-limited with routed scaling), experts that get no token,
another rank's experts (``-1``), a tensor-parallel slice and an expert-parallel shard
adding up to the whole layer, and the pair alignment reading only the routed experts."""

from __future__ import annotations

import pytest
import torch

from model_shards.backends.base import ExpertWeights
from model_shards.backends.cuda.backend import CudaBackend
from model_shards.backends.cuda.triton_ops.fused_moe import fused_moe
from model_shards.backends.cuda.triton_ops.moe_align import align_to_experts, padded_rows
from model_shards.backends.reference import ReferenceBackend
from model_shards.config.moe import MoEConfig
from model_shards.layers.moe import route

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}  # × max |ref|
H, INTER = 48, 40  # hidden: one full and one partial K tile of 32; INTER: a partial N tile
FAMILIES = {  # (E, k, groups, topk_groups, routed scaling, renormalize)
    "mixtral": (8, 2, 1, 1, 1.0, True),
    "qwen_moe": (12, 4, 1, 1, 1.0, False),
    "deepseek_v2": (16, 6, 4, 2, 2.5, False),
}


def _rand(
    shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator, scale: float = 1.0
) -> torch.Tensor:
    return (scale * torch.randn(shape, generator=gen)).to(dtype=dtype, device=DEVICE)


def _layer(family: str, t: int, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """``x [T, H]``, ``w13 [E, 2I, H]``, ``w2 [E, H, I]`` and the family's routing
    ``weights, ids [T, k]``; expert 1 is never chosen (a zero-token expert)."""
    e, k, groups, topk_groups, scaling, renorm = FAMILIES[family]
    gen = torch.Generator().manual_seed(seed)
    x = _rand((t, H), dtype, gen)
    w13 = _rand((e, 2 * INTER, H), dtype, gen, H**-0.5)
    w2 = _rand((e, H, INTER), dtype, gen, INTER**-0.5)
    logits = torch.randn(t, e, generator=gen)
    logits[:, 1] = -30.0
    moe = MoEConfig(e, k, INTER, "softmax", renorm, routed_scaling=scaling, num_groups=groups,
                    topk_groups=topk_groups)  # fmt: skip
    weights, ids = route(logits, moe)
    return x, w13, w2, weights.to(DEVICE), ids.to(DEVICE)


def _check_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.dtype == ref.dtype and out.shape == ref.shape
    err = (out.float() - ref.float()).abs().max().item()
    assert err <= TOL[dtype] * ref.float().abs().max().item(), err


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("t", [1, 7, 19])
def test_matches_reference(one_thread: None, family: str, dtype: torch.dtype, t: int) -> None:
    """T = 19 at k >= 4 has more than 64 pairs: the 64-row blocks."""
    x, w13, w2, weights, ids = _layer(family, t, dtype)
    ids[0, -1] = -1  # one pair on another rank
    out = CudaBackend().fused_moe(x, ExpertWeights(w13, w2), weights, ids)
    ref = ReferenceBackend().fused_moe(x, ExpertWeights(w13, w2), weights, ids)
    _check_close(out, ref, dtype)


def test_tensor_and_expert_parallel_shards_add_up(one_thread: None) -> None:
    """Two ranks' partial sums equal the whole layer, each equal to the reference's partial:
    tp slices every expert's I; ep holds whole experts, other ranks' ids ``-1``."""
    x, w13, w2, weights, ids = _layer("mixtral", 9, torch.float32, seed=3)
    ref_ops = ReferenceBackend()
    whole = ref_ops.fused_moe(x, ExpertWeights(w13, w2), weights, ids)
    half, e_half = INTER // 2, w13.shape[0] // 2
    tp_sum, ep_sum = torch.zeros_like(whole), torch.zeros_like(whole)
    for rank in range(2):
        cols = slice(rank * half, (rank + 1) * half)
        w13_r = torch.cat((w13[:, :INTER][:, cols], w13[:, INTER:][:, cols]), dim=1)  # [E, 2I/2, H]
        shard = ExpertWeights(w13_r, w2[:, :, cols].contiguous())
        part = fused_moe(x, shard.w13, shard.w2, weights, ids)
        _check_close(part, ref_ops.fused_moe(x, shard, weights, ids), torch.float32)
        tp_sum += part
        local = ids - rank * e_half
        local = torch.where((local >= 0) & (local < e_half), local, -1)
        experts = slice(rank * e_half, (rank + 1) * e_half)
        part = fused_moe(x, w13[experts], w2[experts], weights, local)
        _check_close(part, ref_ops.fused_moe(x, ExpertWeights(w13[experts], w2[experts]),
                                             weights, local), torch.float32)  # fmt: skip
        ep_sum += part
    _check_close(tp_sum, whole, torch.float32)
    _check_close(ep_sum, whole, torch.float32)


def test_one_pair_rows_strided_weights_and_no_tokens(one_thread: None) -> None:
    """The data-parallel dispatch's call: one pair per row, ``[N, 1]`` column views of a
    ``[N, 2]`` tensor; rows of no local expert answer zeros; ``T = 0`` an empty result."""
    x, w13, w2, _, _ = _layer("mixtral", 6, torch.float32, seed=5)
    meta = torch.tensor([[3.0, 0.5], [0.0, 1.0], [-1.0, 0.7], [7.0, 0.25], [3.0, 2.0], [2, 1]])
    ids, weights = meta[:, :1].long(), meta[:, 1:]
    out = fused_moe(x, w13, w2, weights, ids)
    ref = ReferenceBackend().fused_moe(x, ExpertWeights(w13, w2), weights.contiguous(), ids)
    _check_close(out, ref, torch.float32)
    assert torch.equal(out[2], torch.zeros(H))
    empty = fused_moe(x[:0], w13, w2, weights[:0], ids[:0])
    assert empty.shape == (0, H)


@pytest.mark.parametrize("block_m", [4, 16])
def test_alignment_covers_each_local_pair_once(block_m: int) -> None:
    gen = torch.Generator().manual_seed(7)
    e, t, k = 6, 11, 3
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)])  # [T, k]
    ids[ids == 4] = 1  # expert 4: no token
    ids[::3, 0] = -1
    blocks = align_to_experts(ids, e, block_m)
    n = t * k
    assert blocks.sorted_pairs.numel() == padded_rows(n, e, block_m)
    pairs = blocks.sorted_pairs.view(-1, block_m)  # [blocks, BM]
    flat = ids.reshape(-1)
    seen: list[int] = []
    for b, expert in enumerate(blocks.block_expert.tolist()):
        real = [p for p in pairs[b].tolist() if p < n]
        assert all(flat[p] == expert for p in real), (b, expert, real)
        assert expert >= 0 or not real
        seen += real
    local = [p for p in range(n) if flat[p] >= 0]
    assert sorted(seen) == local and len(seen) == len(set(seen))
    counts = torch.bincount(flat[flat >= 0], minlength=e)
    used = blocks.block_expert[blocks.block_expert >= 0]
    assert torch.equal(torch.bincount(used, minlength=e), (counts + block_m - 1) // block_m)


def test_a_decode_step_reads_only_its_routed_experts() -> None:
    """One token routed to experts 5 and 2 of 8: the only blocks that run (and so the only
    weights read) are one each of experts 2 and 5."""
    blocks = align_to_experts(torch.tensor([[5, 2]]), 8, 16)
    used = blocks.block_expert[blocks.block_expert >= 0]
    assert used.tolist() == [2, 5]
