"""Multi-LoRA shrink and expand (Punica's BGMV), row by row through a slot per row.

Contract of :meth:`model_shards.backends.base.Backend.add_lora`: each row ``t`` of
``y [T, out]`` whose slot ``s = row_slots[t]`` is ``>= 0`` gains ``(x_t a_s^T) b_s^T``:

    v_t = round(x_t a_s^T)          shrink, float32 sums, rounded to the dtype   [R]
    y_t = round(y_t + v_t b_s^T)    expand, float32 sums, one rounding

The slot of each row is read on the device (``LoraBatch.row_slots``), so one launch serves
any mix of adapters, and a captured graph replays with new slots. Grids: shrink ``[T]``,
expand ``[T, cdiv(out, BLOCK_N)]``; a base-model row (slot ``-1``) returns at once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK_K = 64
_BLOCK_N = 64


@triton.jit
def _shrink_kernel(
    x_ptr: tl.tensor,
    a_ptr: tl.tensor,
    slots_ptr: tl.tensor,
    v_ptr: tl.tensor,
    n_in: int,
    rank: int,
    stride_x: int,
    stride_as: int,
    stride_ar: int,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
) -> None:
    """One program: ``v[t] = x[t] a[slot]^T`` for row ``t = program_id(0)``."""
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + t)
    if slot >= 0:
        rs = tl.arange(0, BLOCK_R)  # [R]
        acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
        a_slot = a_ptr + slot * stride_as
        for k0 in range(0, n_in, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)  # [K]
            x = tl.load(x_ptr + t * stride_x + ks, mask=ks < n_in, other=0.0).to(tl.float32)
            mask = (rs[:, None] < rank) & (ks[None, :] < n_in)
            a = tl.load(a_slot + rs[:, None] * stride_ar + ks[None, :], mask=mask, other=0.0)
            acc += tl.sum(a.to(tl.float32) * x[None, :], axis=1)  # [R]
        tl.store(v_ptr + t * BLOCK_R + rs, acc.to(v_ptr.dtype.element_ty), mask=rs < rank)


@triton.jit
def _expand_kernel(
    v_ptr: tl.tensor,
    b_ptr: tl.tensor,
    slots_ptr: tl.tensor,
    y_ptr: tl.tensor,
    n_out: int,
    rank: int,
    stride_y: int,
    stride_bs: int,
    stride_bn: int,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
) -> None:
    """One program: columns ``program_id(1) * BLOCK_N ..`` of ``y[t] += v[t] b[slot]^T``."""
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + t)
    if slot >= 0:
        rs = tl.arange(0, BLOCK_R)  # [R]
        ns = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [N]
        v = tl.load(v_ptr + t * BLOCK_R + rs, mask=rs < rank, other=0.0).to(tl.float32)
        mask = (ns[:, None] < n_out) & (rs[None, :] < rank)
        b_slot = b_ptr + slot * stride_bs
        b = tl.load(b_slot + ns[:, None] * stride_bn + rs[None, :], mask=mask, other=0.0)
        delta = tl.sum(b.to(tl.float32) * v[None, :], axis=1)  # [N]
        y_row = y_ptr + t * stride_y + ns
        y = tl.load(y_row, mask=ns < n_out, other=0.0).to(tl.float32)
        tl.store(y_row, (y + delta).to(y_ptr.dtype.element_ty), mask=ns < n_out)


def add_lora(
    y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, row_slots: torch.Tensor
) -> None:
    """``y [T, out] +=`` each row's ``(x_t a_s^T) b_s^T``, in place; ``x [T, in]``, ``a [S, R,
    in]``, ``b [S, out, R]`` (unit stride along their last dims), ``row_slots [T]`` int64."""
    t, n_in = x.shape
    rank, n_out = a.shape[1], y.shape[1]
    if a.shape[2] != n_in or b.shape[1] != n_out or b.shape[2] != rank or y.shape[0] != t:
        raise ValueError(
            f"add_lora: x {tuple(x.shape)}, a {tuple(a.shape)}, b {tuple(b.shape)}, "
            f"y {tuple(y.shape)} do not fit"
        )
    if y.stride(1) != 1:
        raise ValueError("add_lora: y must have unit stride along its columns")
    if t == 0:
        return
    x, a, b = x.contiguous(), a.contiguous(), b.contiguous()
    block_r = max(16, triton.next_power_of_2(rank))
    v = torch.empty((t, block_r), dtype=x.dtype, device=x.device)
    _shrink_kernel[(t,)](
        x,
        a,
        row_slots,
        v,
        n_in,
        rank,
        x.stride(0),
        a.stride(0),
        a.stride(1),
        BLOCK_R=block_r,
        BLOCK_K=_BLOCK_K,
    )
    _expand_kernel[(t, triton.cdiv(n_out, _BLOCK_N))](
        v,
        b,
        row_slots,
        y,
        n_out,
        rank,
        y.stride(0),
        b.stride(0),
        b.stride(1),
        BLOCK_R=block_r,
        BLOCK_N=_BLOCK_N,
    )
