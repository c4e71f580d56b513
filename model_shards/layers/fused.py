"""RMSNorm (with the residual add), SiLU-and-multiply and the row argmax of greedy
sampling, each one call: a fused CPU kernel where
:func:`model_shards.kernels.use_cpu_kernels` says so, else PyTorch ops that round the
same way (the reference the kernels are tested against, and the GPU path). Rotary and
decode attention are fused the same way in ``attention.py``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from model_shards.kernels import use_cpu_kernels


def rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x: [T, H]`` → ``(norm(s), s)`` where ``s = x + residual`` (rounded to the dtype),
    or ``s = x`` without a residual. ``y = w * round(s / rms(s))``, statistics in float32.

    The kernel updates ``residual`` in place and returns it as ``s``.
    """
    if use_cpu_kernels(x):
        y = torch.ops.shardserve_cpu.rms_norm(x, residual, weight, eps)
        return y, residual if residual is not None else x
    s = x if residual is None else x + residual
    s32 = s.float()
    s32 = s32 * torch.rsqrt(s32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * s32.to(s.dtype), s


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``x = [gate | up]: [T, 2I]`` → ``silu(gate) * up: [T, I]``."""
    if use_cpu_kernels(x):
        return torch.ops.shardserve_cpu.silu_and_mul(x)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def argmax(x: torch.Tensor) -> torch.Tensor:
    """``x: [S, V]`` → ``[S]`` int64, torch.argmax's answer (first maximum; a NaN wins)."""
    if use_cpu_kernels(x) and x.stride(-1) == 1:
        return torch.ops.shardserve_cpu.argmax(x)
    return x.argmax(dim=-1)
