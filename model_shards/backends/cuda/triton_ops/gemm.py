"""Batch-invariant dense GEMM: ``y = x W^T + b`` with a reduction order that ignores ``T``.

Contract (the ``linear`` op of :class:`model_shards.backends.base.Backend`)::

    x [T, in], W [out, in], b [out] | None  ->  y [T, out] in x's dtype
    y[t, n] = round( (sum_k x[t, k] * W[n, k]) + b[n] )     # sum and bias in float32

Batch invariance: row ``t`` of ``y`` is bitwise the same whatever else is in the batch
(its size, its other rows; on a GPU also the row's position in its tile: Triton's
interpreter runs ``tl.dot`` as numpy/OpenBLAS sgemm, which is not). This holds because

* the tile configuration (:func:`gemm_config`: ``BLOCK_M/N/K``, warps, stages) is a
  function of the dtype only, never of ``T``; there is no split-K and no autotuning;
* every output tile is owned by one program, which walks K from 0 upwards in steps of
  ``BLOCK_K``: ``acc = dot(x[:, k0:k0+BK], W[n, k0:k0+BK]^T, acc)``, so each element
  is summed in the same order for every ``T``;
* ``T`` is not specialised on (``do_not_specialize``): one compiled kernel serves every
  batch size, rows past ``T`` load zeros and are never stored;
* the bias is added to the float32 accumulator, then the sum is rounded once to the
  output dtype (fixed: bias *before* the final rounding).

float32 inputs use ``input_precision="ieee"`` (no TF32) so results are accurate and
reproducible; 16-bit inputs (bfloat16/float16) run the tensor cores with float32
accumulation. (In Triton's interpreter only, bfloat16 tiles are widened to float32
before ``tl.dot``, exactly: its dot multiplies bfloat16 bit patterns, triton-lang/triton
#11584. bf16 x bf16 products are exact in float32, so this models the tensor cores.)
Offsets are computed in int64 (weights past 2^31 elements are fine);
scalar sizes and strides are passed as int32. ``in`` (K) is a compile-time constant: it is
fixed per weight (one compile per distinct ``in`` of a model), gives the K loop a known
trip count, and keeps the loop bound a Python int in Triton's interpreter (which, with
numpy >= 2.4, cannot ``range()`` over a runtime scalar argument).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

_SUPPORTED = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class GemmConfig:
    """One fixed tile configuration; powers of two, every ``tl.dot`` dim >= 16."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int  # program-order swizzle for L2 reuse; no effect on the numbers
    num_warps: int
    num_stages: int


_FP32_CONFIG = GemmConfig(block_m=64, block_n=64, block_k=32, group_m=8, num_warps=4, num_stages=3)
_HALF_CONFIG = GemmConfig(block_m=64, block_n=128, block_k=32, group_m=8, num_warps=4, num_stages=4)


def gemm_config(in_features: int, out_features: int, dtype: torch.dtype) -> GemmConfig:
    """The tile configuration of a ``[*, in] x [out, in]^T`` GEMM. Deliberately takes no
    batch size: it may depend on the weight's shape and the dtype only (today: the dtype)."""
    del in_features, out_features  # reserved for shape-specific tuning; T must never enter
    if dtype == torch.float32:
        return _FP32_CONFIG
    return _HALF_CONFIG


@triton.jit(do_not_specialize=["M"])
def _linear_kernel(
    x_ptr: tl.tensor,
    w_ptr: tl.tensor,
    b_ptr: tl.tensor,
    y_ptr: tl.tensor,
    M: int,
    N: int,
    K: tl.constexpr,
    stride_xm: int,
    stride_xk: int,
    stride_wn: int,
    stride_wk: int,
    stride_ym: int,
    HAS_BIAS: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
) -> None:
    """One program: the ``[BLOCK_M, BLOCK_N]`` output tile ``pid`` (grouped order)."""
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows

    offs_m = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    offs_n = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    offs_k = tl.arange(0, BLOCK_K)  # [BK]
    mask_m = offs_m < M
    mask_n = offs_n < N
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk  # [BM, BK]
    w_ptrs = w_ptr + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk  # [BK, BN]

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):  # fixed order: k0 = 0, BK, 2 BK, ...
        mask_k = offs_k < K - k0
        a = tl.load(x_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)  # [BM, BK]
        b = tl.load(w_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)  # [BK, BN]
        if UPCAST:  # interpreter only: its tl.dot multiplies bfloat16 bit patterns
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)  # [BM, BN] float32
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K * stride_wk

    if HAS_BIAS:
        bias = tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)  # [BN]
        acc += bias[None, :]
    y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]  # [BM, BN]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


# what ``triton.jit`` chose when the kernel was defined (``TRITON_INTERPRET=1``: CPU)
_INTERPRETED = not isinstance(_linear_kernel, triton.runtime.JITFunction)


def _check(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """Raise ``ValueError`` naming the argument when shapes, dtypes or devices disagree."""
    if x.dim() != 2 or weight.dim() != 2:
        raise ValueError(
            f"linear: x must be [T, in] and weight [out, in], got "
            f"x {tuple(x.shape)}, weight {tuple(weight.shape)}"
        )
    if x.shape[1] != weight.shape[1]:
        raise ValueError(f"linear: x has in={x.shape[1]} but weight {tuple(weight.shape)}")
    if x.dtype not in _SUPPORTED or weight.dtype != x.dtype:
        raise ValueError(
            f"linear: x and weight must share one of {_SUPPORTED}, got {x.dtype} and {weight.dtype}"
        )
    if weight.device != x.device:
        raise ValueError(f"linear: x on {x.device} but weight on {weight.device}")
    if bias is not None and (bias.shape != (weight.shape[0],) or bias.device != x.device):
        raise ValueError(
            f"linear: bias must be [{weight.shape[0]}] on {x.device}, got "
            f"{tuple(bias.shape)} on {bias.device}"
        )


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x [T, in]`` → ``x W^T + b: [T, out]`` in x's dtype, batch-invariant (module doc).

    ``x`` may have any row stride; a tensor whose columns are not unit-stride (and a
    non-contiguous ``weight``) is copied contiguous first. ``bias`` may be any float dtype:
    it is read as float32."""
    _check(x, weight, bias)
    if x.stride(1) != 1:
        x = x.contiguous()
    if weight.stride(1) != 1:
        weight = weight.contiguous()
    t, k = x.shape
    n = weight.shape[0]
    y = torch.empty((t, n), dtype=x.dtype, device=x.device)  # [T, out]
    if t == 0 or n == 0:
        return y
    cfg = gemm_config(k, n, x.dtype)
    upcast = _INTERPRETED and x.dtype == torch.bfloat16
    # "tf32" is Triton's default and only means something for float32 operands
    precision = "ieee" if x.dtype == torch.float32 or upcast else "tf32"
    grid = (triton.cdiv(t, cfg.block_m) * triton.cdiv(n, cfg.block_n),)
    _linear_kernel[grid](
        x,
        weight,
        bias if bias is not None else y,
        y,
        t,
        n,
        k,
        x.stride(0),
        x.stride(1),
        weight.stride(0),
        weight.stride(1),
        y.stride(0),
        HAS_BIAS=bias is not None,
        PRECISION=precision,
        UPCAST=upcast,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        GROUP_M=cfg.group_m,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return y
