"""Token bitmasks and the per-row logit adjustments of one sampling step (torch only).

Layout (xgrammar's): a mask over ``V`` tokens is ``W = ceil(V / 32)`` int32 words; token
``t`` is allowed when bit ``t % 32`` of word ``t // 32`` is set. On the wire a mask is
those words as little-endian bytes (:class:`model_shards.messages.TokenMask`).

:func:`adjust_logits` is what the sampler applies to the raw logits before anything else
(penalties, temperature, the draw), on whatever device the logits live: it adds each
row's ``logit_bias`` and sets disallowed tokens to ``-inf``. Rows not named are left
bitwise untouched.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

BITS = 32


def num_words(vocab_size: int) -> int:
    """Words of one mask over ``vocab_size`` tokens."""
    return -(-vocab_size // BITS)


def pack(allowed: Sequence[int], vocab_size: int) -> torch.Tensor:
    """The mask ``[W]`` int32 allowing exactly ``allowed`` (ids ``< vocab_size``)."""
    bits = torch.zeros(num_words(vocab_size) * BITS, dtype=torch.bool)
    bits[torch.tensor(list(allowed), dtype=torch.int64)] = True
    weights = torch.tensor([1 << i for i in range(BITS)], dtype=torch.int64)
    words = (bits.view(-1, BITS).to(torch.int64) * weights).sum(-1)  # [W] in 0 .. 2^32 - 1
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def from_bytes(data: bytes, vocab_size: int) -> torch.Tensor:
    """A wire mask → ``[W]`` int32; ``ValueError`` if its length does not fit ``vocab_size``."""
    if len(data) != 4 * num_words(vocab_size):
        raise ValueError(
            f"token mask of {len(data)} bytes; a vocabulary of {vocab_size} needs "
            f"{4 * num_words(vocab_size)}"
        )
    return torch.frombuffer(bytearray(data), dtype=torch.int32)


_BYTE_BITS: dict[torch.device, torch.Tensor] = {}  # [256, 8] bool: the bits of each byte


def unpack(words: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``words [R, W]`` int32 → ``[R, vocab_size]`` bool, on ``words``' device (one table
    lookup per byte of the little-endian words)."""
    table = _BYTE_BITS.get(words.device)
    if table is None:
        bits = (torch.arange(256)[:, None] >> torch.arange(8)) & 1
        table = _BYTE_BITS[words.device] = bits.bool().to(words.device)
    octets = words.contiguous().view(torch.uint8).long()  # [R, 4 W], low byte first
    return table[octets].reshape(words.shape[0], -1)[:, :vocab_size]


@dataclass
class RowAdjustment:
    """What one row of a step changes: ``bias`` (token ids, values) added to its logits,
    ``mask`` (``[W]`` int32) of the tokens it may sample (``None``: all)."""

    row: int
    bias: tuple[torch.Tensor, torch.Tensor] | None = None  # ([n] int64, [n] float32)
    mask: torch.Tensor | None = None


def adjust_logits(logits: torch.Tensor, rows: Sequence[RowAdjustment]) -> torch.Tensor:
    """Float32 ``logits [S, V]`` with ``rows``' bias added and masks applied (a new tensor).

    Finite bias ids of one row are distinct (a repeated id adds ``-inf``: a banned word),
    so the result does not depend on the scatter's order on any device. A row whose mask
    allows nothing keeps its logits (the sampler never gets an all ``-inf`` row)."""
    x = logits.float()
    s, v = x.shape
    device = x.device
    biased = [r for r in rows if r.bias is not None and len(r.bias[0])]
    if biased:
        idx = torch.cat([r.bias[0] + r.row * v for r in biased if r.bias is not None])
        val = torch.cat([r.bias[1] for r in biased if r.bias is not None])
        x = x.clone()
        x.view(-1).index_add_(0, idx.to(device), val.to(device))
    masked = [r for r in rows if r.mask is not None]
    if not masked:
        return x if biased else x.clone()
    words = torch.stack([r.mask for r in masked if r.mask is not None]).to(device)  # [R, W]
    words[(words == 0).all(-1)] = -1  # nothing allowed: leave the row alone
    allowed = unpack(words, v)  # [R, V]
    if len(masked) == s and all(r.row == i for i, r in enumerate(masked)):
        return torch.where(allowed, x, float("-inf"))
    x = x if biased else x.clone()
    index = torch.tensor([r.row for r in masked], dtype=torch.int64, device=device)
    x[index] = torch.where(allowed, x[index], float("-inf"))
    return x
