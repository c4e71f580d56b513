# mypy: allow-untyped-defs
# (the @triton.jit kernels: their parameters are Triton values, typed by Triton)
"""e4m3 (``float8_e4m3fn``) rounding in Triton, and the FP8 K/V pools of
``--kv-cache-dtype fp8``, elementwise:

    stored = e4m3(clamp(k / k_scale, ±448))        read = round_dtype(float32(stored) · k_scale)

(and the same for v with ``v_scale``), as torch rounds: correctly rounded division, then
round-to-nearest-even onto the e4m3 grid (:func:`round_e4m3`, in float32 arithmetic, so the
final cast is exact: Triton's interpreter casts to FP8 rounding ties away from zero). A pool
of the model's dtype passes through both unchanged.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from model_shards.backends.cuda.triton_ops.norm import round_to

FP8_KV_DTYPE = torch.float8_e4m3fn
_FP8_MAX = 448.0


def is_fp8(pool: torch.Tensor) -> bool:
    """Whether ``pool`` holds e4m3 values (scaled as above)."""
    return pool.dtype == FP8_KV_DTYPE


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
def to_pool(x, scale, KV_FP8: tl.constexpr, pool_dtype: tl.constexpr):
    """float32 ``x`` → the pool's dtype (e4m3 of ``x / scale``, clamped, for FP8 pools)."""
    if KV_FP8:
        x = round_e4m3(tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -_FP8_MAX), _FP8_MAX))
    return x.to(pool_dtype)


@triton.jit
def from_pool(x, scale, KV_FP8: tl.constexpr, DTYPE: tl.constexpr):
    """Pool values → ``DTYPE`` (``float32(x) · scale`` rounded to nearest-even, for FP8
    pools)."""
    if KV_FP8:
        return round_to(x.to(tl.float32) * scale, DTYPE).to(DTYPE)
    return x
