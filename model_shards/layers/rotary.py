"""Rotary position embeddings (RoPE), with ``linear``, ``llama3``, ``longrope`` and ``yarn``
scaling (``yarn``: the frequencies of :func:`_yarn_frequencies`, cos and sin multiplied by
``rope.attention_factor`` as for ``longrope``).

Half-split ("NeoX") layout as in Hugging Face Llama: for each head,
``x' = x * cos + rotate_half(x) * sin`` with ``rotate_half([a, b]) = [-b, a]``.
Angles are ``position * inv_freq`` in float32, cached for every position; the
backend's ``rotary_and_cache`` applies them.

``longrope`` (Phi-3's "su" scaling): ``inv_freq_i = 1 / (f_i * theta^(2i/R))`` with one
factor ``f_i`` per frequency, ``short_factor`` or ``long_factor``, and both cos and sin
multiplied by ``rope.attention_factor`` (the "mscale"). Which factors a position uses,
per position: ``p < original_max_position_embeddings`` the short ones, else the long
ones. Transformers picks one set per *sequence* (the long one for every position once
the sequence is longer than the original maximum, recomputing its cache when it
crosses), so the two agree on every sequence of at most
``original_max_position_embeddings`` tokens and differ, for longer ones, at the
positions below it. vLLM picks one set per *deployment* (the long one everywhere when
``max_model_len > original_max_position_embeddings``; earlier versions chose per step:
the long one for every token of a step in which any position exceeded the maximum).
Per position keeps a table per position, the same for every sequence of a step (batch
invariant) and each cached key rotated once.

Partial rotary (``rotary_dim R < head_dim D``: only the first ``R`` dims of a head turn,
pairing dim ``i`` with ``i + R/2``): the tables turn the first ``R/2`` dims of each half of
the head (angle 0, cos 1 and sin 0, on the rest), which is that rotation when the head's
dims are stored in the order :func:`rotary_head_order` gives (the model's q and k weights
are loaded in that order; ``q . k`` does not change when both are permuted alike).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from model_shards.config.rope import RopeConfig


def inverse_frequencies(head_dim: int, rope: RopeConfig, *, long: bool = False) -> torch.Tensor:
    """``[head_dim / 2]`` float32 inverse frequencies after scaling (``head_dim``: the
    rotated dims; ``long``: longrope's long factors instead of its short ones)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    if rope.rope_type == "longrope":
        factors = torch.tensor(rope.long_factor if long else rope.short_factor)
        if factors.shape != exponents.shape:
            which = "long_factor" if long else "short_factor"
            raise ValueError(
                f"config.json rope {which} has {factors.numel()} entries, expected "
                f"{exponents.numel()} (half the rotary dim {head_dim})"
            )
        return 1.0 / (factors * rope.theta**exponents)
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.rope_type == "yarn":
        return _yarn_frequencies(head_dim, inv_freq, rope)
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        low_wavelen = rope.original_max_position_embeddings / rope.low_freq_factor
        high_wavelen = rope.original_max_position_embeddings / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (rope.original_max_position_embeddings / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    return inv_freq


def _yarn_frequencies(head_dim: int, inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    """YaRN (as transformers computes it): frequencies that turn fewer than ``beta_slow``
    times over the original context are interpolated (divided by ``factor``), those
    turning more than ``beta_fast`` times kept, a linear ramp between."""

    def correction_dim(rotations: float) -> float:
        turns = rope.original_max_position_embeddings / (rotations * 2 * math.pi)
        return head_dim * math.log(turns) / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    high = high + 0.001 if low == high else high  # no singularity
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (the high frequencies), 0: interpolate
    return inv_freq / rope.factor * (1 - keep) + inv_freq * keep


def rotary_angles(rotary_dim: int, max_positions: int, rope: RopeConfig) -> torch.Tensor:
    """``[P, rotary_dim / 2]`` float32 angles ``p * inv_freq`` (longrope: the short factors
    below ``original_max_position_embeddings``, the long ones from there on)."""
    positions = torch.arange(max_positions, dtype=torch.float32)
    freqs = torch.outer(positions, inverse_frequencies(rotary_dim, rope))  # [P, R/2]
    if rope.rope_type == "longrope":
        long = torch.outer(positions, inverse_frequencies(rotary_dim, rope, long=True))
        beyond = positions >= rope.original_max_position_embeddings
        freqs = torch.where(beyond[:, None], long, freqs)
    return freqs


def rotary_head_order(head_dim: int, rotary_dim: int) -> torch.Tensor:
    """``[head_dim]`` int64: stored dim ``j`` of a q/k head holds original dim ``order[j]``.

    The halves of the stored head are ``[rot_1, pass_1]`` and ``[rot_2, pass_2]``, where
    ``rot_1, rot_2`` are the two halves of the ``rotary_dim`` rotated dims and ``pass_1,
    pass_2`` the two halves of the rest: the half-split rotation over the whole head then
    pairs the rotated dims as a rotation over the first ``rotary_dim`` dims does. The
    identity when ``rotary_dim == head_dim``.
    """
    r, rest = rotary_dim // 2, (head_dim - rotary_dim) // 2
    if rotary_dim % 2 or (head_dim - rotary_dim) % 2 or not 0 < rotary_dim <= head_dim:
        raise ValueError(f"rotary dim {rotary_dim} of head dim {head_dim}: both parts must be even")
    rot, passed = torch.arange(rotary_dim), torch.arange(rotary_dim, head_dim)
    return torch.cat((rot[:r], passed[:rest], rot[r:], passed[rest:]))


class RotaryEmbedding(nn.Module):
    """``cos_cached, sin_cached: [max_positions, head_dim]`` float32 tables, both halves
    equal; ``rotary_dim`` (default ``head_dim``): see the module docstring."""

    def __init__(
        self, head_dim: int, max_positions: int, rope: RopeConfig, rotary_dim: int | None = None
    ) -> None:
        super().__init__()
        rotary_dim = head_dim if rotary_dim is None else rotary_dim
        rotary_head_order(head_dim, rotary_dim)  # checks the split
        freqs = rotary_angles(rotary_dim, max_positions, rope)  # [P, R/2]
        cos, sin = freqs.cos(), freqs.sin()
        if rope.rope_type in ("longrope", "yarn"):
            cos, sin = cos * rope.attention_factor, sin * rope.attention_factor
        if rotary_dim < head_dim:  # the pass-through dims: angle 0, no scaling
            rest = (max_positions, (head_dim - rotary_dim) // 2)
            cos = torch.cat((cos, torch.ones(rest)), dim=-1)  # [P, D/2]
            sin = torch.cat((sin, torch.zeros(rest)), dim=-1)
        self.cos_cached: torch.Tensor
        self.sin_cached: torch.Tensor
        self.register_buffer("cos_cached", torch.cat((cos, cos), dim=-1), persistent=False)
        self.register_buffer("sin_cached", torch.cat((sin, sin), dim=-1), persistent=False)
