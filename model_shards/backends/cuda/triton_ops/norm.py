"""RMSNorm with the fused residual add, one Triton program per row.

Contract of :meth:`model_shards.backends.base.Backend.rms_norm`, rounded exactly like
:class:`model_shards.backends.reference.ReferenceBackend`:

    s = round(x + residual)                         (s = x without a residual)
    n = round(s32 * 1 / sqrt(mean(s32²) + eps))     statistics in float32
    y = round(w32 * n)                              = the dtype's w * n, rounded once

``round`` is round-to-nearest-even into the dtype. A product of two bf16 (or fp16)
values is exact in float32, so ``round(w32 * n)`` is bitwise torch's ``w * n`` in the
dtype. ``s`` is written into ``residual`` in place and ``residual`` is returned.

Batch invariance: a row's answer depends on that row only. The block (the next power
of two ≥ H, masked) and the warp count come from ``H`` alone, never from ``T``, so the
reduction order of a row is the same in every batch.

:func:`round_to` is the rounding helper the other op modules share. It rounds with
integer arithmetic: Triton's interpreter truncates float32 → bf16 casts instead of
rounding them, and on a GPU native fp16 casts let the compiler fuse a rounded product
into an add. The result is bitwise what ``cvt.rn.{bf16,f16}.f32`` gives.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _round_bf16(x: tl.tensor) -> tl.tensor:
    """float32 → nearest-even bf16 value (as float32): keep the top 16 bits."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = bits + 0x7FFF + ((bits >> 16) & 1)  # carries into the kept half
    rounded = (bits & 0xFFFF0000).to(tl.float32, bitcast=True)
    return tl.where(x != x, x, rounded)  # NaN stays NaN


@triton.jit
def _round_fp16(x: tl.tensor) -> tl.tensor:
    """float32 → nearest-even fp16 value (as float32): 11 significant bits in the normal
    range, multiples of 2^-24 below 2^-14, ±inf from 65520 up."""
    bits = x.to(tl.uint32, bitcast=True)
    sign = bits & 0x80000000
    normal = ((bits + 0xFFF + ((bits >> 13) & 1)) & 0xFFFFE000).to(tl.float32, bitcast=True)
    # 1.5 * 2^23 added then taken away rounds |x| * 2^24 (< 2^10 where used) to an integer, RTNE
    small = tl.minimum(tl.abs(x), 1.0)  # the branch is only taken below 2^-14
    tiny = ((small * 16777216.0 + 12582912.0) - 12582912.0) * 5.9604644775390625e-08
    tiny = (tiny.to(tl.uint32, bitcast=True) | sign).to(tl.float32, bitcast=True)
    rounded = tl.where(tl.abs(x) < 6.103515625e-05, tiny, normal)
    inf = (sign | 0x7F800000).to(tl.float32, bitcast=True)
    rounded = tl.where(tl.abs(rounded) > 65504.0, inf, rounded)
    return tl.where(x != x, x, rounded)


@triton.jit
def round_to(x: tl.tensor, dtype: tl.constexpr) -> tl.tensor:
    """Round float32 ``x`` to nearest-even in ``dtype`` (float32, bfloat16 or float16);
    returns float32 holding values ``dtype`` represents exactly, so a later store or
    cast into ``dtype`` is exact. Integer arithmetic, which the compiler cannot fold
    into a neighbouring multiply (it shrinks ``fptrunc(fmul(fpext a, fpext b))`` into
    an fp16 multiply and then contracts it with an add into an ``fma.rn.f16``)."""
    if dtype == tl.bfloat16:
        return _round_bf16(x)
    elif dtype == tl.float16:
        return _round_fp16(x)
    else:
        return x


@triton.jit
def _rms_norm_kernel(
    x_ptr: tl.tensor,
    res_ptr: tl.tensor,
    w_ptr: tl.tensor,
    y_ptr: tl.tensor,
    stride_x: int,
    stride_res: int,
    stride_y: int,
    h: int,
    h_float: float,
    eps: float,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
) -> None:
    """One program: row ``program_id(0)`` of ``[T, H]``."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)  # [BLOCK]
    mask = cols < h
    dtype = x_ptr.dtype.element_ty
    s = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        res_ptrs = res_ptr + row * stride_res + cols
        r = tl.load(res_ptrs, mask=mask, other=0.0).to(tl.float32)
        s = round_to(s + r, dtype)
        tl.store(res_ptrs, s.to(dtype), mask=mask)
    mean_sq = tl.div_rn(tl.sum(s * s, axis=0), h_float)  # [] fixed order for a given BLOCK
    inv_rms = tl.div_rn(1.0, tl.sqrt_rn(mean_sq + eps))
    n = round_to(s * inv_rms, dtype)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    out_dtype = y_ptr.dtype.element_ty
    y = round_to(w * n, out_dtype)
    tl.store(y_ptr + row * stride_y + cols, y.to(out_dtype), mask=mask)


def _row_major(t: torch.Tensor, name: str) -> None:
    if t.dim() != 2 or t.stride(1) != 1:
        raise ValueError(f"rms_norm: {name} must be [T, H] with unit stride along H")


def rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x: [T, H]`` (and ``residual`` of the same shape and dtype, written in place),
    ``weight: [H]`` → ``(y, s)``; ``y`` has the dtype ``weight * x`` promotes to."""
    _row_major(x, "x")
    t, h = x.shape
    if residual is not None:
        _row_major(residual, "residual")
        if residual.shape != x.shape or residual.dtype != x.dtype:
            raise ValueError(
                f"rms_norm: residual {tuple(residual.shape)} {residual.dtype} must match "
                f"x {tuple(x.shape)} {x.dtype}"
            )
    if weight.shape != (h,):
        raise ValueError(f"rms_norm: weight {tuple(weight.shape)} must be [{h}]")
    weight = weight.contiguous()
    s = x if residual is None else residual
    y = torch.empty((t, h), dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    if t == 0:
        return y, s
    block = triton.next_power_of_2(h)
    _rms_norm_kernel[(t,)](
        x,
        s,
        weight,
        y,
        x.stride(0),
        s.stride(0),
        y.stride(0),
        h,
        float(h),
        eps,
        HAS_RESIDUAL=residual is not None,
        BLOCK=block,
        num_warps=min(max(block // 512, 1), 16),
    )
    return y, s
