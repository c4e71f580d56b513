# mypy: allow-untyped-defs
# (the @triton.jit kernels: their parameters are Triton values, typed by Triton)
"""e4m3 (``float8_e4m3fn``) rounding in Triton, and the FP8 K/V pools of
``--kv-cache-dtype fp8``, elementwise:

    stored = e4m3(clamp(k / k_scale, ±448))        read = round_dtype(float32(stored) · k_scale)

(and the same for v with ``v_scale``), as torch rounds: correctly rounded division, then
round-to-nearest-even onto the e4m3 grid (:func:`round_e4m3`, in float32 arithmetic). A pool
of the model's dtype passes through both unchanged.

The kernels see e4m3 tensors as their bytes (``uint8`` views, :func:`as_bytes`) and encode and
decode them with integer arithmetic (:func:`e4m3_bits`, :func:`e4m3_value`): Triton has no
``fp8e4nv`` type below sm89 (A100), and its interpreter casts to FP8 rounding ties away from
zero. Only the FP8 GEMM's native ``tl.dot`` (sm89+) takes them typed.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from model_shards.backends.cuda.triton_ops.norm import round_to

FP8_KV_DTYPE = torch.float8_e4m3fn
_FP8_MAX = tl.constexpr(448.0)


def is_fp8(pool: torch.Tensor) -> bool:
    """Whether ``pool`` holds e4m3 values (scaled as above)."""
    return pool.dtype == FP8_KV_DTYPE


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """An e4m3 tensor as the ``uint8`` view the kernels take; any other unchanged."""
    return t.view(torch.uint8) if is_fp8(t) else t


@triton.jit
def round_e4m3(v):
    """float32 ``v`` with ``|v| <= 448`` → the nearest e4m3 value (ties to even), float32.

    The grid step at ``|v|`` is ``q = 2^(max(e, -6) - 3)``, ``e`` its exponent (below 2^-6:
    subnormals, step 2^-9); adding and subtracting ``1.5 · 2^23 · q`` rounds to it in
    float32's own round-to-nearest-even."""
    a = tl.abs(v)
    e = ((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    step = ((tl.maximum(e, -6) - 3 + 127) << 23).to(tl.float32, bitcast=True)
    magic = step * 12582912.0  # 1.5 * 2^23 * step
    r = (a + magic) - magic
    return tl.where(v < 0, -r, r)


@triton.jit
def e4m3_bits(r):
    """float32 ``r`` on the e4m3 grid (``|r| <= 448``) → its ``float8_e4m3fn`` bits, uint8:
    sign, 4 exponent bits (bias 7), 3 mantissa bits; below 2^-6, ``r / 2^-9`` (subnormal)."""
    i = r.to(tl.int32, bitcast=True)
    sign = (i >> 24) & 0x80
    a = tl.abs(r)
    normal = ((((i >> 23) & 0xFF) - 120) << 3) | ((i >> 20) & 7)  # exponent - 127 + 7
    sub = (a * 512.0).to(tl.int32)
    return (tl.where(a >= 0.015625, normal, sub) | sign).to(tl.uint8)


@triton.jit
def e4m3_value(b):
    """``float8_e4m3fn`` bits (uint8) → the float32 value."""
    b = b.to(tl.int32)
    e = (b >> 3) & 0xF
    m = b & 7
    normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    v = tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal)  # subnormal: m 2^-9
    return tl.where((b & 0x80) != 0, -v, v)


@triton.jit
def to_pool(x, scale, KV_FP8: tl.constexpr, pool_dtype: tl.constexpr):
    """float32 ``x`` → the pool's dtype (FP8 pools, seen as bytes: the e4m3 bits of
    ``x / scale``, clamped)."""
    if KV_FP8:
        v = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -_FP8_MAX), _FP8_MAX)
        return e4m3_bits(round_e4m3(v))
    return x.to(pool_dtype)


@triton.jit
def from_pool(x, scale, KV_FP8: tl.constexpr, DTYPE: tl.constexpr):
    """Pool values → ``DTYPE`` (FP8 pools' bytes: ``value · scale`` rounded to nearest-even)."""
    if KV_FP8:  # noqa: SIM108 (one return: a compiled kernel types every return alike)
        y = round_to(e4m3_value(x) * scale, DTYPE).to(DTYPE)
    else:
        y = x
    return y
