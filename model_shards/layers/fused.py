"""RMSNorm (with the residual add), SiLU-and-multiply, the row argmax of greedy
sampling and the random draw of sampling (:func:`exponential_race`), each one call:
a fused CPU kernel where :func:`model_shards.kernels.use_cpu_kernels` says so, else
PyTorch ops that round the same way (the reference the kernels are tested against,
and the GPU path). Rotary and decode attention are fused the same way in
``attention.py``.
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


_GOLDEN = 0x9E3779B97F4A7C15
_MIX1, _MIX2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def _int64(value: int) -> int:
    """A 64-bit pattern as the int64 torch holds it (two's complement)."""
    return value - (1 << 64) if value >= 1 << 63 else value


def _shift_right(z: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical (unsigned) right shift of int64 bit patterns; torch's ``>>`` is arithmetic."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def race_uniforms(seeds: torch.Tensor, vocab: int) -> torch.Tensor:
    """``seeds [S]`` int64 → ``[S, vocab]`` float64 uniforms in (0, 1): token ``i``'s is the
    splitmix64 finalizer of ``seed + (i + 1) × golden`` (int64 arithmetic wraps), top 53 bits."""
    counters = torch.arange(1, vocab + 1, dtype=torch.int64, device=seeds.device)
    z = seeds[:, None] + counters * _int64(_GOLDEN)
    z = (z ^ _shift_right(z, 30)) * _int64(_MIX1)
    z = (z ^ _shift_right(z, 27)) * _int64(_MIX2)
    z = z ^ _shift_right(z, 31)
    return (_shift_right(z, 11).double() + 0.5) * 2.0**-53


def exponential_race(probs: torch.Tensor, seeds: torch.Tensor) -> torch.Tensor:
    """One draw per row of ``probs [S, V]`` (float32, non-negative, any positive sum) →
    ``[S]`` int64: token ``i`` with probability ``p_i / sum p``.

    The winner is ``argmin_i -log(u_i) / p_i`` with :func:`race_uniforms` of the row's
    seed (Gumbel-max; the draw of ``torch.multinomial`` for one sample, but with a
    counter-based uniform per token instead of a generator's stream). A row with no
    positive mass answers 0.
    """
    if use_cpu_kernels(probs) and probs.dtype == torch.float32 and probs.stride(-1) == 1:
        return torch.ops.shardserve_cpu.exponential_race(probs, seeds)
    ratio = -race_uniforms(seeds, probs.shape[-1]).log() / probs.double()
    ratio = torch.where(probs > 0, ratio, torch.inf)
    return ratio.argmin(dim=-1)
