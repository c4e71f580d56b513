"""splitmix64 (Steele, Lea and Flood 2014): the one hash behind every seed and random draw.

* token ``i`` of a row seeded ``s`` draws ``splitmix64(s, i + 1)`` (the backends'
  ``exponential_race``; ``backends/cpu/kernels/sampling_ops.cpp`` and
  ``backends/cuda/triton_ops/sampling.py`` repeat these constants);
* position ``p`` of a request seeded ``s``: ``mix64(s × GOLDEN + p + 1)``
  (:func:`model_shards.worker.sampler.position_seed`);
* sample ``j > 0`` of a request: ``splitmix64(s, j)`` (:func:`server.api.choices.sample_seed`).

No imports, so the frontend may use it.
"""

from __future__ import annotations

MASK64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15  # 2^64 / the golden ratio: the stream's increment
# mix64: z = (z ^ z >> shift) × multiplier for each round, then z ^ z >> FINAL_SHIFT
MIX_ROUNDS: tuple[tuple[int, int], ...] = ((30, 0xBF58476D1CE4E5B9), (27, 0x94D049BB133111EB))
FINAL_SHIFT = 31


def mix64(z: int) -> int:
    """splitmix64's output function of the 64-bit pattern of ``z`` (any int, taken mod 2^64)."""
    z &= MASK64
    for shift, multiplier in MIX_ROUNDS:
        z = ((z ^ (z >> shift)) * multiplier) & MASK64
    return z ^ (z >> FINAL_SHIFT)


def splitmix64(seed: int, index: int = 1) -> int:
    """Output ``index`` (1 = the first) of the splitmix64 stream seeded with ``seed``: an int in
    ``[0, 2^64)``. ``splitmix64(0)`` is 0xE220A8397B1DCDAF, the reference's first output."""
    return mix64(seed + index * GOLDEN)
