"""SiLU-and-mul of the gated MLP: ``x = [gate | up]: [T, 2I]`` → ``silu(gate) * up: [T, I]``.

Contract of :meth:`model_shards.backends.base.Backend.silu_and_mul`, rounded like the
reference ``F.silu(gate) * up`` in the dtype:

    a = round(g32 / (1 + exp(-g32)))     silu in float32, rounded to the dtype
    y = round(a * u32)                   the dtype's product, rounded once

(a product of two bf16/fp16 values is exact in float32). Elementwise, so a row's answer
never depends on the batch. Grid: ``[T, cdiv(I, BLOCK)]``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from model_shards.backends.cuda.triton_ops.norm import round_to

_MAX_BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(
    x_ptr: tl.tensor,
    y_ptr: tl.tensor,
    stride_x: int,
    stride_y: int,
    inter: int,
    BLOCK: tl.constexpr,
) -> None:
    """One program: columns ``program_id(1) * BLOCK ..`` of row ``program_id(0)``."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
    mask = cols < inter
    dtype = y_ptr.dtype.element_ty
    x_row = x_ptr + row * stride_x
    gate = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_row + inter + cols, mask=mask, other=0.0).to(tl.float32)
    act = round_to(tl.div_rn(gate, 1.0 + tl.exp(-gate)), dtype)
    y = round_to(act * up, dtype)
    tl.store(y_ptr + row * stride_y + cols, y.to(dtype), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``x: [T, 2I]`` (unit stride along its columns) → ``[T, I]`` in ``x``'s dtype."""
    if x.dim() != 2 or x.shape[1] % 2:
        raise ValueError(f"silu_and_mul: x {tuple(x.shape)} must be [T, 2I]")
    if x.stride(1) != 1:
        x = x.contiguous()
    t, inter = x.shape[0], x.shape[1] // 2
    y = torch.empty((t, inter), dtype=x.dtype, device=x.device)
    if t == 0 or inter == 0:
        return y
    block = min(triton.next_power_of_2(inter), _MAX_BLOCK)
    _silu_and_mul_kernel[(t, triton.cdiv(inter, block))](
        x, y, x.stride(0), y.stride(0), inter, BLOCK=block, num_warps=4 if block >= 512 else 1
    )
    return y
