# mypy: allow-untyped-defs
# (the @triton.jit kernels: their parameters are Triton values, typed by Triton)
"""FP8 W8A8: the activations' rounding to e4m3 and the GEMM of ``Backend.fp8_linear``.

* :func:`quantize_rows`: ``x [M, K]`` → ``(q [M, K] float8_e4m3fn, s [M] float32)`` with
  ``s = min(max_k |x|, ub) / 448`` per row (a zero row: 1; ``ub``: FBGEMM's bound, else
  none) or the static ``input_scale``, and
  ``q = e4m3(clamp(x / s, ±448))``, correctly rounded division and round-to-nearest-even
  (:func:`.e4m3.round_e4m3`):
  bitwise :func:`model_shards.quant.fp8.quantize_activations` (``x̂ = q · s``);
* :func:`fp8_matmul`: ``y = (q_x q_w^T) · s_x[m] · s_w[n] + b``, float32 accumulation, one
  rounding to the output dtype; fixed tiles and K order (batch-invariant). The operands go to
  ``tl.dot`` as e4m3 where the GPU multiplies FP8 (sm89+), else upcast in the tile to
  bfloat16 (exact: every e4m3 value is a bfloat16), or to float32 in Triton's interpreter,
  whose ``tl.dot`` has no FP8. The e4m3 products are exact in float32 either way, so the
  paths differ from each other and from the reference (``x̂ W^T`` in float32) only by the
  order of the float32 sum and where the scales are applied.

``CudaBackend.fp8_linear`` takes :func:`torch._scaled_mm` (cuBLASLt, row-wise scales) instead
of :func:`fp8_matmul` on FP8 GPUs unless ``--batch-invariant``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from model_shards.backends.cuda.triton_ops.e4m3 import e4m3_bits, e4m3_value, round_e4m3
from model_shards.backends.cuda.triton_ops.norm import round_to
from model_shards.quant.fp8 import FP8_MAX, Fp8Weight

_QUANT_BLOCK = 1024  # columns per step of the row kernel
_BLOCK_M, _BLOCK_N, _BLOCK_K = 64, 64, 64  # fixed: the K order of every row


@triton.jit
def _quant_rows_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    static_ptr,
    stride_xm,
    stride_qm,
    ub,
    K: tl.constexpr,
    STATIC: tl.constexpr,
    HAS_UB: tl.constexpr,
    FP8_MAX: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Grid ``(M,)``: row ``m``'s scale (amax pass, unless ``STATIC``) then its e4m3 values."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    x_row = x_ptr + row * stride_xm
    if STATIC:
        s = tl.load(static_ptr).to(tl.float32)
    else:
        amax = tl.zeros([BLOCK], tl.float32)
        for k0 in range(0, K, BLOCK):
            xk = tl.load(x_row + k0 + offs, mask=k0 + offs < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(xk))
        row_max = tl.max(amax, 0)
        if HAS_UB:
            row_max = tl.minimum(row_max, ub)
        s = tl.math.div_rn(row_max, FP8_MAX)
        s = tl.where(s == 0.0, 1.0, s)
    tl.store(s_ptr + row, s)
    for k0 in range(0, K, BLOCK):
        mask = k0 + offs < K
        xk = tl.load(x_row + k0 + offs, mask=mask, other=0.0).to(tl.float32)
        v = round_e4m3(tl.minimum(tl.maximum(tl.math.div_rn(xk, s), -FP8_MAX), FP8_MAX))
        tl.store(q_ptr + row * stride_qm + k0 + offs, e4m3_bits(v), mask=mask)


def quantize_rows(
    x: torch.Tensor, input_scale: torch.Tensor | None, scale_ub: float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` → ``(q [M, K] float8_e4m3fn, s [M] float32)`` (module doc);
    ``input_scale``: a one-element float tensor on ``x``'s device, or ``None`` (dynamic);
    ``scale_ub``: the bound of a dynamic row's ``max |x|``, or ``None``."""
    if x.dim() != 2:
        raise ValueError(f"quantize_rows: x must be [M, K], got {tuple(x.shape)}")
    x = x if x.stride(1) == 1 else x.contiguous()
    m, k = x.shape
    q = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty((m,), dtype=torch.float32, device=x.device)
    if m == 0:
        return q, s
    static = input_scale.reshape(1).float() if input_scale is not None else s
    _quant_rows_kernel[(m,)](
        x, q.view(torch.uint8), s, static, x.stride(0), q.stride(0),
        0.0 if scale_ub is None else float(scale_ub),
        K=k, STATIC=input_scale is not None, HAS_UB=scale_ub is not None, FP8_MAX=FP8_MAX,
        BLOCK=min(_QUANT_BLOCK, triton.next_power_of_2(k)),
    )  # fmt: skip
    return q, s


@triton.jit(do_not_specialize=["M"])
def _fp8_gemm_kernel(
    xq_ptr,
    sx_ptr,
    w_ptr,
    sw_ptr,
    b_ptr,
    y_ptr,
    M,
    N,
    stride_xm,
    stride_wn,
    stride_ym,
    K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    OPERAND: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """One ``[BLOCK_M, BLOCK_N]`` tile of ``y``, K walked upwards from 0. ``OPERAND``:
    ``"fp8"`` (e4m3 pointers, native dot), ``"bf16"`` or ``"f32"`` (bytes, decoded in the
    tile)."""
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    offs_m = (pid // num_n).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    offs_n = (pid % num_n).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    mask_m = offs_m < M
    mask_n = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        a = tl.load(
            xq_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
            mask=mask_m[:, None] & mask_k[None, :],
            other=0.0,
        )  # [BM, BK] e4m3 (its bytes unless "fp8")
        b = tl.load(
            w_ptr + offs_n[None, :] * stride_wn + offs_k[:, None],
            mask=mask_k[:, None] & mask_n[None, :],
            other=0.0,
        )  # [BK, BN] e4m3 (its bytes unless "fp8")
        if OPERAND == "f32":
            acc = tl.dot(e4m3_value(a), e4m3_value(b), acc, input_precision="ieee")
        elif OPERAND == "bf16":  # exact: every e4m3 value is a bfloat16
            acc = tl.dot(e4m3_value(a).to(tl.bfloat16), e4m3_value(b).to(tl.bfloat16), acc)
        else:
            acc = tl.dot(a, b, acc)
    sx = tl.load(sx_ptr + offs_m, mask=mask_m, other=0.0)  # [BM]
    sw = tl.load(sw_ptr + offs_n, mask=mask_n, other=0.0)  # [BN]
    acc = acc * sx[:, None] * sw[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    out = round_to(acc, y_ptr.dtype.element_ty).to(y_ptr.dtype.element_ty)
    tl.store(ptrs, out, mask=mask_m[:, None] & mask_n[None, :])


_INTERPRETED = not isinstance(_fp8_gemm_kernel, triton.runtime.JITFunction)


def fp8_operand(device: torch.device) -> str:
    """What ``tl.dot`` gets on ``device``: ``"fp8"`` (sm89+), ``"bf16"``, or ``"f32"``
    (Triton's interpreter). Asked once per backend, not per call."""
    if _INTERPRETED or device.type != "cuda":
        return "f32"
    return "fp8" if torch.cuda.get_device_capability(device) >= (8, 9) else "bf16"


def fp8_matmul(
    xq: torch.Tensor,
    x_scale: torch.Tensor,
    weight: Fp8Weight,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    operand: str,
) -> torch.Tensor:
    """``xq [M, K]`` e4m3, ``x_scale [M]`` float32 → ``[M, N]`` in ``out_dtype`` (module
    doc); ``operand``: :func:`fp8_operand`'s answer."""
    w = weight.weight if weight.weight.stride(1) == 1 else weight.weight.contiguous()
    m, k = xq.shape
    n = weight.out_features
    if w.shape[1] != k or weight.scale.shape != (n,):
        raise ValueError(
            f"fp8_linear: x has K={k}, weight {tuple(w.shape)}, scale {tuple(weight.scale.shape)}"
        )
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"fp8_linear: bias must be [{n}], got {tuple(bias.shape)}")
    y = torch.empty((m, n), dtype=out_dtype, device=xq.device)  # [M, N]
    if m == 0 or n == 0:
        return y
    if operand != "fp8":  # the kernel decodes the bytes (e4m3.py)
        xq, w = xq.view(torch.uint8), w.view(torch.uint8)
    grid = (triton.cdiv(m, _BLOCK_M) * triton.cdiv(n, _BLOCK_N),)
    _fp8_gemm_kernel[grid](
        xq, x_scale, w, weight.scale.float(), bias if bias is not None else y, y, m, n,
        xq.stride(0), w.stride(0), y.stride(0),
        K=k, HAS_BIAS=bias is not None, OPERAND=operand,
        BLOCK_M=_BLOCK_M, BLOCK_N=_BLOCK_N, BLOCK_K=_BLOCK_K, num_warps=4, num_stages=3,
    )  # fmt: skip
    return y


def scaled_mm(
    xq: torch.Tensor, x_scale: torch.Tensor, weight: Fp8Weight, bias: torch.Tensor | None
) -> torch.Tensor:
    """cuBLASLt's FP8 GEMM with row-wise scales (``x_scale [M, 1]``, ``w.scale [1, N]``),
    bfloat16 out; the bias added in float32 to the product, rounded again (FP8 GPUs only)."""
    y = torch._scaled_mm(
        xq,
        weight.weight.t(),  # [K, N] column-major, as cuBLASLt wants the second operand
        scale_a=x_scale.reshape(-1, 1),
        scale_b=weight.scale.float().reshape(1, -1),
        out_dtype=torch.bfloat16,
    )
    if bias is not None:
        y = (y.float() + bias.float()).to(torch.bfloat16)
    return y
