"""A simple per-sequence KV cache: contiguous K/V tensors per (layer, sequence).

Each sequence's cache grows (by doubling) with the tokens it actually holds,
so memory tracks tokens in flight, not batch × max length. Paged blocks replace
this in the continuous-batching engine.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SequenceKV:
    k: torch.Tensor  # [num_kv_heads, capacity, head_dim]
    v: torch.Tensor
    length: int = 0


class KVCache:
    """K/V of every sequence for the attention layers of this rank's stage."""

    def __init__(
        self, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = device
        self._layers: dict[int, dict[int, SequenceKV]] = {}

    def append(
        self, layer: int, seq_id: int, start: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``k, v: [nkv, L, D]`` at ``start..start+L``; return all ``[nkv, start+L, D]``."""
        seqs = self._layers.setdefault(layer, {})
        entry = seqs.get(seq_id)
        if entry is None:
            if start != 0:
                raise RuntimeError(f"sequence {seq_id} has no KV cache but starts at {start}")
            entry = seqs[seq_id] = SequenceKV(self._empty(k.shape[1]), self._empty(k.shape[1]))
        if start > entry.length:
            raise RuntimeError(f"sequence {seq_id}: gap in KV cache ({entry.length} < {start})")
        end = start + k.shape[1]
        if end > entry.k.shape[1]:
            capacity = max(end, 2 * entry.k.shape[1])
            entry.k = self._grow(entry.k, capacity, entry.length)
            entry.v = self._grow(entry.v, capacity, entry.length)
        entry.k[:, start:end] = k
        entry.v[:, start:end] = v
        entry.length = end
        return entry.k[:, :end], entry.v[:, :end]

    def free(self, seq_id: int) -> None:
        for seqs in self._layers.values():
            seqs.pop(seq_id, None)

    def num_tokens(self) -> int:
        """Tokens held in the first layer (every layer holds the same)."""
        first = next(iter(self._layers.values()), {})
        return sum(e.length for e in first.values())

    def _empty(self, capacity: int) -> torch.Tensor:
        return torch.empty(
            self.num_kv_heads,
            max(capacity, 16),
            self.head_dim,
            dtype=self.dtype,
            device=self.device,
        )

    def _grow(self, t: torch.Tensor, capacity: int, used: int) -> torch.Tensor:
        new = self._empty(capacity)
        new[:, :used] = t[:, :used]
        return new
