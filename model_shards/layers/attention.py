"""Causal self-attention over packed sequences with a KV cache.

A step packs the new tokens of several sequences into one ``[T, ...]`` batch.
:class:`ForwardBatch` says which rows belong to which sequence and where each
chunk starts; attention runs per sequence against that sequence's cached keys.
Grouped-query attention: ``nh`` query heads share ``nkv`` key/value heads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from model_shards.kv_cache import KVCache


@dataclass
class ForwardBatch:
    """Metadata of one packed step, the same on every rank."""

    positions: torch.Tensor  # [T] absolute position of each token
    seq_ids: list[int]
    starts: list[int]  # first position of each chunk
    lengths: list[int]  # tokens of each chunk; sum == T
    kv: KVCache

    @property
    def num_tokens(self) -> int:
        return sum(self.lengths)


class Attention(nn.Module):
    def __init__(self, layer_idx: int, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch
    ) -> torch.Tensor:
        """``q: [T, nh, D]``, ``k, v: [T, nkv, D]`` → ``[T, nh * D]``."""
        out = torch.empty_like(q)
        row = 0
        for seq_id, start, length in zip(batch.seq_ids, batch.starts, batch.lengths, strict=True):
            q_s = q[row : row + length].transpose(0, 1)  # (nh, L, D)
            k_all, v_all = batch.kv.append(
                self.layer_idx,
                seq_id,
                start,
                k[row : row + length].transpose(0, 1),
                v[row : row + length].transpose(0, 1),
            )  # (nkv, start+L, D)
            mask = None
            causal = length > 1 and start == 0
            if length > 1 and start > 0:
                rows = torch.arange(length, device=q.device).unsqueeze(1) + start
                mask = torch.arange(start + length, device=q.device).unsqueeze(0) <= rows
            o = F.scaled_dot_product_attention(
                q_s.unsqueeze(0), k_all.unsqueeze(0), v_all.unsqueeze(0),
                attn_mask=mask, is_causal=causal, scale=self.scale,
                enable_gqa=self.num_heads != self.num_kv_heads,
            )  # fmt: skip  # (1, nh, L, D)
            out[row : row + length] = o[0].transpose(0, 1)
            row += length
        return out.reshape(out.shape[0], self.num_heads * self.head_dim)
