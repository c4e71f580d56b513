"""The seeded random draw of sampling (:meth:`Backend.exponential_race`), one Triton
program per row.

Contract of :meth:`model_shards.backends.base.Backend.exponential_race`, with the
numbers of :class:`model_shards.backends.reference.ReferenceBackend`: for row ``r``
with seed ``s`` and token ``i`` of ``probs [S, V]``

    z   = s + (i + 1) * 0x9E3779B97F4A7C15                  (uint64, wrapping)
    z   = (z ^ z >> 30) * 0xBF58476D1CE4E5B9                (splitmix64 finalizer)
    z   = (z ^ z >> 27) * 0x94D049BB133111EB
    z   = z ^ z >> 31
    u_i = ((z >> 11) + 0.5) * 2^-53                          float64 in (0, 1)
    winner = argmin_i  -log(u_i) / p_i   over p_i > 0         float64, first index on ties

and 0 for a row with no positive mass (``race_uniforms`` is this hash in int64
arithmetic; the bit patterns are the same). The program walks the row in tiles of
``BLOCK`` tokens; each lane keeps its own running (best ratio, best index), and one
reduction at the end takes the smallest ratio and, among equal ones, the smallest
index, so the answer is the reference's whatever the tile size.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_MAX_BLOCK = 2048  # tokens per tile


@triton.jit
def _uniforms(seed: tl.tensor, tokens: tl.tensor) -> tl.tensor:
    """``seed`` (uint64) and token ids ``tokens [BLOCK]`` (int64) → float64 uniforms."""
    z = seed + (tokens + 1).to(tl.uint64) * 0x9E3779B97F4A7C15  # wraps mod 2^64
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9  # >> on uint64 is the logical shift
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB
    z = z ^ (z >> 31)
    return ((z >> 11).to(tl.float64) + 0.5) * 1.1102230246251565e-16  # 2^-53, exact


@triton.jit
def _race_kernel(
    probs_ptr: tl.tensor,
    seeds_ptr: tl.tensor,
    out_ptr: tl.tensor,
    stride_row: int,
    VOCAB: tl.constexpr,
    BLOCK: tl.constexpr,
) -> None:
    """One program: row ``program_id(0)`` of ``probs [S, V]`` → its winner in ``out [S]``."""
    row = tl.program_id(0).to(tl.int64)
    seed = tl.load(seeds_ptr + row).to(tl.uint64)  # the int64 bit pattern
    lanes = tl.arange(0, BLOCK).to(tl.int64)  # [BLOCK]
    best = tl.full([BLOCK], float("inf"), tl.float64)  # per lane: smallest ratio so far
    best_idx = tl.zeros([BLOCK], tl.int64)  # ... and its token (the first one reaching it)
    for start in range(0, VOCAB, BLOCK):
        tokens = start + lanes  # [BLOCK]
        inside = tokens < VOCAB
        p = tl.load(probs_ptr + row * stride_row + tokens, mask=inside, other=0.0)
        p = p.to(tl.float64)
        live = inside & (p > 0)  # NaN mass is no mass, as in the reference
        ratio = -tl.log(_uniforms(seed, tokens)) / tl.where(live, p, 1.0)  # [BLOCK]
        ratio = tl.where(live, ratio, float("inf"))
        better = ratio < best  # strict: a later token never takes a tie from this lane
        best = tl.where(better, ratio, best)
        best_idx = tl.where(better, tokens, best_idx)
    smallest = tl.min(best, axis=0)  # []
    first = tl.min(tl.where(best == smallest, best_idx, VOCAB), axis=0)
    winner = tl.where(smallest < float("inf"), first, 0)  # no positive mass: 0
    tl.store(out_ptr + row, winner)


def exponential_race(probs: torch.Tensor, seeds: torch.Tensor) -> torch.Tensor:
    """One draw per row of ``probs [S, V]`` (non-negative; float32, or a 16-bit float
    read exactly) with ``seeds [S]`` int64 → ``[S]`` int64 (see the module docstring).

    ``probs`` rows may be strided; the vocab dimension is made contiguous if it is not.
    """
    if probs.dim() != 2 or seeds.shape != probs.shape[:1]:
        raise ValueError(
            f"exponential_race: probs must be [S, V] and seeds [S], got "
            f"{tuple(probs.shape)} and {tuple(seeds.shape)}"
        )
    if probs.stride(1) != 1:
        probs = probs.contiguous()
    rows, vocab = probs.shape
    out = torch.zeros(rows, dtype=torch.int64, device=probs.device)
    if rows == 0 or vocab == 0:
        return out
    seeds = seeds.to(device=probs.device, dtype=torch.int64).contiguous()
    block = min(max(triton.next_power_of_2(vocab), 16), _MAX_BLOCK)
    _race_kernel[(rows,)](
        probs,
        seeds,
        out,
        probs.stride(0),
        VOCAB=vocab,
        BLOCK=block,
        num_warps=8 if block >= 1024 else 4,
    )
    return out
