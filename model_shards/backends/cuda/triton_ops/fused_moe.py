"""Sparse MoE experts: grouped GEMMs that read only the routed experts' weights.

Contract of :meth:`model_shards.backends.base.Backend.fused_moe`::

    x [T, H], w13 [E, 2I, H] (gate rows, then up rows), w2 [E, H, I],
    topk_weights [T, k] float32, topk_ids [T, k] int64 (-1: another rank's expert)
    out[t] = round( sum_j w[t, j] * y_j )    summed in float32, ascending expert order
    y_j    = round(down_e(h)),  h = round(round(silu(round(gate_e x[t]))) * round(up_e x[t]))

with ``round`` to ``x``'s dtype where the reference's ``F.linear``/``F.silu`` round.

Three launches after :func:`.moe_align.align_to_experts` (pairs sorted by expert, padded
into blocks of ``BLOCK_M`` rows of one expert):

1. ``_gate_up_kernel``, grid ``[blocks, cdiv(I, BLOCK_N)]``: a block's rows of ``x``
   (gathered by token) times its expert's gate and up tiles, SiLU-and-mul in the
   epilogue → ``h [N, I]`` by pair;
2. ``_down_kernel``, grid ``[blocks, cdiv(H, BLOCK_N)]``: ``h`` rows times the expert's
   down tile → ``y [N, H]`` by pair, rounded to the dtype (as the reference's down is);
3. ``_combine_kernel``, grid ``[T, cdiv(H, BLOCK_H)]``: each token's ``k`` rows of ``y``
   times their routing weights, added in float32 in ascending expert order (other ranks'
   pairs skipped), rounded once.

A block past the last expert's span exits at once, so a decode step's weight traffic is
its routed experts' (``T k`` of them at most), not all ``E``. Every shape depends on
``(T, k, E)`` only: CUDA graphs capture it. The tile configuration depends on the dtype
and, unless ``batch_invariant``, on ``N``; each row's dot runs its K loop from 0 up.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from model_shards.backends.cuda.triton_ops.moe_align import ExpertBlocks, align_to_experts
from model_shards.backends.cuda.triton_ops.norm import round_to


@triton.jit
def _gate_up_kernel(
    x_ptr: tl.tensor,
    w_ptr: tl.tensor,
    pairs_ptr: tl.tensor,
    block_expert_ptr: tl.tensor,
    h_ptr: tl.tensor,
    num_pairs: int,
    stride_xt: int,
    stride_we: int,
    stride_wn: int,
    TOP_K: tl.constexpr,
    HIDDEN: tl.constexpr,
    INTER: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
) -> None:
    """One program: block ``program_id(0)``'s rows × columns ``program_id(1)`` of ``h``."""
    expert = tl.load(block_expert_ptr + tl.program_id(0))
    if expert < 0:
        return
    offs_m = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    pairs = tl.load(pairs_ptr + offs_m)  # [BM] int64
    valid = pairs < num_pairs
    tokens = pairs // TOP_K  # [BM]
    offs_n = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    mask_n = offs_n < INTER
    offs_k = tl.arange(0, BLOCK_K)  # [BK]
    x_ptrs = x_ptr + tokens[:, None] * stride_xt + offs_k[None, :]  # [BM, BK]
    g_ptrs = w_ptr + expert * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None]  # [BK, BN]
    u_ptrs = g_ptrs + INTER * stride_wn
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, HIDDEN, BLOCK_K):
        mask_k = offs_k < HIDDEN - k0
        a = tl.load(x_ptrs, mask=valid[:, None] & mask_k[None, :], other=0.0)  # [BM, BK]
        g = tl.load(g_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)  # [BK, BN]
        u = tl.load(u_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        if UPCAST:  # interpreter only: its tl.dot multiplies bfloat16 bit patterns
            a, g, u = a.to(tl.float32), g.to(tl.float32), u.to(tl.float32)
        acc_g = tl.dot(a, g, acc_g, input_precision=PRECISION)  # [BM, BN]
        acc_u = tl.dot(a, u, acc_u, input_precision=PRECISION)
        x_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    dtype = h_ptr.dtype.element_ty
    gate = round_to(acc_g, dtype)
    act = round_to(tl.div_rn(gate, 1.0 + tl.exp(-gate)), dtype)  # F.silu, rounded
    h = round_to(act * round_to(acc_u, dtype), dtype)
    h_ptrs = h_ptr + pairs[:, None] * INTER + offs_n[None, :]  # [BM, BN]
    tl.store(h_ptrs, h.to(dtype), mask=valid[:, None] & mask_n[None, :])


@triton.jit
def _down_kernel(
    h_ptr: tl.tensor,
    w_ptr: tl.tensor,
    pairs_ptr: tl.tensor,
    block_expert_ptr: tl.tensor,
    y_ptr: tl.tensor,
    num_pairs: int,
    stride_we: int,
    stride_wn: int,
    HIDDEN: tl.constexpr,
    INTER: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
) -> None:
    """One program: block ``program_id(0)``'s rows × columns ``program_id(1)`` of ``y``."""
    expert = tl.load(block_expert_ptr + tl.program_id(0))
    if expert < 0:
        return
    offs_m = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    pairs = tl.load(pairs_ptr + offs_m)  # [BM]
    valid = pairs < num_pairs
    offs_n = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    mask_n = offs_n < HIDDEN
    offs_k = tl.arange(0, BLOCK_K)
    h_ptrs = h_ptr + pairs[:, None] * INTER + offs_k[None, :]  # [BM, BK]
    w_ptrs = w_ptr + expert * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None]  # [BK, BN]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, INTER, BLOCK_K):
        mask_k = offs_k < INTER - k0
        a = tl.load(h_ptrs, mask=valid[:, None] & mask_k[None, :], other=0.0)  # [BM, BK]
        b = tl.load(w_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)  # [BK, BN]
        if UPCAST:
            a, b = a.to(tl.float32), b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
        h_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    y = acc.to(y_ptr.dtype.element_ty)  # [BM, BN], F.linear's rounding
    y_ptrs = y_ptr + pairs[:, None] * HIDDEN + offs_n[None, :]  # [BM, BN]
    tl.store(y_ptrs, y, mask=valid[:, None] & mask_n[None, :])


@triton.jit
def _combine_kernel(
    y_ptr: tl.tensor,
    weights_ptr: tl.tensor,
    ids_ptr: tl.tensor,
    slot_order_ptr: tl.tensor,
    out_ptr: tl.tensor,
    TOP_K: tl.constexpr,
    HIDDEN: tl.constexpr,
    BLOCK_H: tl.constexpr,
) -> None:
    """One program: columns ``program_id(1)`` of token ``program_id(0)``'s output."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # [BH]
    mask = cols < HIDDEN
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):  # slots in ascending expert order
        pair = t * TOP_K + tl.load(slot_order_ptr + t * TOP_K + j)
        local = tl.load(ids_ptr + pair) >= 0
        y = tl.load(y_ptr + pair * HIDDEN + cols, mask=mask & local, other=0.0)
        acc += y.to(tl.float32) * tl.load(weights_ptr + pair)
    tl.store(out_ptr + t * HIDDEN + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


# what ``triton.jit`` chose when the kernels were defined (``TRITON_INTERPRET=1``: CPU)
_INTERPRETED = not isinstance(_gate_up_kernel, triton.runtime.JITFunction)


def _tiles(dtype: torch.dtype, num_pairs: int, batch_invariant: bool) -> tuple[int, int, int]:
    """``(BLOCK_M, BLOCK_N, BLOCK_K)``; a decode step's few pairs take the smallest M."""
    block_m = 16 if batch_invariant or num_pairs <= 64 else 64
    if _INTERPRETED:
        return block_m, 32, 32
    return block_m, 64, 32 if dtype == torch.float32 else 64


def _check(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, ids: torch.Tensor) -> None:
    """Raise ``ValueError`` naming the argument whose shape disagrees."""
    e, two_i, h = w13.shape
    if x.dim() != 2 or x.shape[1] != h or two_i % 2 or w2.shape != (e, h, two_i // 2):
        raise ValueError(
            f"fused_moe: x [T, H], w13 [E, 2I, H], w2 [E, H, I] expected, got "
            f"{tuple(x.shape)}, {tuple(w13.shape)}, {tuple(w2.shape)}"
        )
    if ids.dim() != 2 or ids.shape[0] != x.shape[0]:
        raise ValueError(f"fused_moe: topk_ids {tuple(ids.shape)} must be [T, k], T = {len(x)}")


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    batch_invariant: bool = False,
) -> torch.Tensor:
    """``x [T, H]`` through the routed local experts → ``[T, H]`` in ``x``'s dtype (module
    doc). ``topk_weights`` may be any float ``[T, k]`` view; it is read as float32."""
    _check(x, w13, w2, topk_ids)
    (t, hidden), (e, two_i, _), k = x.shape, w13.shape, topk_ids.shape[1]
    out = torch.empty_like(x)  # [T, H]
    if t == 0 or k == 0:
        return out.zero_()
    x, w13, w2 = x.contiguous(), w13.contiguous(), w2.contiguous()
    ids = topk_ids.to(torch.int64).contiguous()  # [T, k]
    weights = topk_weights.to(torch.float32).reshape(-1).contiguous()  # [N]
    n, inter = t * k, two_i // 2
    block_m, block_n, block_k = _tiles(x.dtype, n, batch_invariant)
    blocks: ExpertBlocks = align_to_experts(ids, e, block_m)
    upcast = _INTERPRETED and x.dtype == torch.bfloat16
    precision = "ieee" if x.dtype == torch.float32 or upcast else "tf32"
    tiles = {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k}
    common = {"PRECISION": precision, "UPCAST": upcast, "num_warps": 4, **tiles}
    h = torch.empty((n, inter), dtype=x.dtype, device=x.device)  # [N, I] by pair
    grid13 = (blocks.num_blocks, triton.cdiv(inter, block_n))
    _gate_up_kernel[grid13](
        x, w13, blocks.sorted_pairs, blocks.block_expert, h, n, x.stride(0),
        w13.stride(0), w13.stride(1), TOP_K=k, HIDDEN=hidden, INTER=inter, **common,
    )  # fmt: skip
    y = torch.empty((n, hidden), dtype=x.dtype, device=x.device)  # [N, H] by pair
    grid2 = (blocks.num_blocks, triton.cdiv(hidden, block_n))
    _down_kernel[grid2](
        h, w2, blocks.sorted_pairs, blocks.block_expert, y, n,
        w2.stride(0), w2.stride(1), HIDDEN=hidden, INTER=inter, **common,
    )  # fmt: skip
    slot_order = torch.argsort(torch.where(ids < 0, e, ids), dim=1, stable=True)  # [T, k]
    block_h = min(triton.next_power_of_2(hidden), 1024)
    _combine_kernel[(t, triton.cdiv(hidden, block_h))](
        y,
        weights,
        ids,
        slot_order,
        out,
        TOP_K=k,
        HIDDEN=hidden,
        BLOCK_H=block_h,
        num_warps=4,
        enable_fp_fusion=False,  # the product rounded before the add, as the reference
    )
    return out
