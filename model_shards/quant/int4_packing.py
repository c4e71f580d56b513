"""The int32 words 4-bit checkpoints pack their values in, and the bytes
:class:`~model_shards.quant.int4.Int4GroupWeight` keeps them in.

A word holds eight 4-bit values along one dimension, value ``i`` in bits ``4i .. 4i + 3``: in
the order of that dimension (GPTQ, compressed-tensors: word ``j`` holds ``8j .. 8j + 7``), or
in AWQ's interleaved order, where value ``i`` of word ``j`` is ``8j + AWQ_ORDER[i]``.
"""

from __future__ import annotations

import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
_AWQ_INVERSE = tuple(AWQ_ORDER.index(c) for c in range(8))  # column c is value _AWQ_INVERSE[c]


def unpack_int32(words: torch.Tensor, dim: int, awq_order: bool = False) -> torch.Tensor:
    """``words`` int32, 2-D → uint8 values in 0..15, eight per word along ``dim``."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=words.device)
    vals = (words.unsqueeze(-1) >> shifts) & 0xF  # [a, b, 8]
    if awq_order:
        vals = vals[..., list(_AWQ_INVERSE)]
    vals = vals.to(torch.uint8)
    rows, cols = words.shape
    if dim == 1:
        return vals.reshape(rows, cols * 8)
    return vals.permute(0, 2, 1).reshape(rows * 8, cols)


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """``q [N, K]`` uint8 0..15 (``K`` even) → ``[N, K / 2]``: even ``k`` low, odd ``k`` high."""
    pairs = q.reshape(q.shape[0], -1, 2)
    return (pairs[..., 0] | (pairs[..., 1] << 4)).contiguous()
