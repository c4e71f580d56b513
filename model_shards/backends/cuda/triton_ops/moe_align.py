"""The (token, expert) pairs of a MoE step sorted by expert and padded into row blocks, for
the grouped GEMMs of :mod:`.fused_moe`.

Pair ``p = t * k + j`` is token ``t``'s ``j``-th routed expert ``topk_ids[t, j]`` (``-1``:
another rank's, never computed here). Expert ``e``'s ``c_e`` pairs take rows
``start_e .. start_e + c_e - 1`` of ``sorted_pairs`` in pair order, and its span is padded
to a multiple of ``block_m`` with the sentinel ``N = T * k``, so every ``block_m`` rows
belong to one expert (``block_expert``; ``-1``: a block past the last expert's span).

All torch, every shape a function of ``(N, E, block_m)`` alone (no host sync, nothing
data-dependent), so CUDA graphs capture it: ``P`` rows, the most the padding can need,
``N + min(N, E) (block_m - 1)`` rounded up to ``block_m``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ExpertBlocks:
    """A step's pairs by expert: ``P / block_m`` blocks of ``block_m`` rows."""

    sorted_pairs: torch.Tensor  # [P] int64 pair ids; padding: num_pairs
    block_expert: torch.Tensor  # [P / block_m] int64 local expert; -1: an unused block
    num_pairs: int  # N = T * k
    block_m: int

    @property
    def num_blocks(self) -> int:
        return int(self.block_expert.shape[0])


def padded_rows(num_pairs: int, num_experts: int, block_m: int) -> int:
    """``P``: enough rows for any routing of ``num_pairs`` pairs over ``num_experts``."""
    worst = num_pairs + min(num_pairs, num_experts) * (block_m - 1)
    return -(-worst // block_m) * block_m


def align_to_experts(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertBlocks:
    """``topk_ids [T, k]`` int64 (``-1`` or ``0 .. E - 1``) → :class:`ExpertBlocks`."""
    flat = topk_ids.reshape(-1)  # [N]
    n, e, dev = flat.numel(), num_experts, flat.device
    key = torch.where(flat < 0, e, flat)  # [N]; other ranks' experts sort last
    counts = torch.zeros(e + 1, dtype=torch.int64, device=dev)
    counts.scatter_add_(0, key, torch.ones_like(key))  # [E + 1]
    padded = (counts[:e] + block_m - 1) // block_m * block_m  # [E]
    ends = padded.cumsum(0)  # [E], exclusive end of each expert's span
    starts = torch.cat((ends - padded, ends.new_zeros(1)))  # [E + 1]
    first = counts.cumsum(0) - counts  # [E + 1], each expert's first sorted index
    order = torch.argsort(key, stable=True)  # [N], pairs by expert, pair order within
    sorted_key = key[order]  # [N]
    rank = torch.arange(n, device=dev) - first[sorted_key]  # [N], index within its expert
    rows = padded_rows(n, e, block_m)
    dest = torch.where(sorted_key < e, starts[sorted_key] + rank, rows)  # [N]; rows: dropped
    sorted_pairs = torch.full((rows + 1,), n, dtype=torch.int64, device=dev)
    sorted_pairs.scatter_(0, dest, order)
    block_starts = torch.arange(0, rows, block_m, device=dev)  # [P / block_m]
    block_expert = torch.searchsorted(ends, block_starts, right=True)  # first span ending after
    block_expert = torch.where(block_expert < e, block_expert, -1)
    return ExpertBlocks(sorted_pairs[:rows], block_expert, n, block_m)
