"""Causal self-attention over packed sequences and a paged KV cache.

A step packs the new tokens of several sequences into one ``[T, ...]`` batch.
:class:`ForwardBatch` (built once per step, shared by all layers) says where
each new token's K/V goes (``slot_mapping``) and which slots each sequence
attends to. Single-token chunks (decodes) run as one padded batch; longer
chunks (prefill) run one by one with a causal mask offset by their start.
Grouped-query attention: ``nh`` query heads share ``nkv`` key/value heads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from model_shards.kv_cache import PagedKVCache
from model_shards.messages import SeqChunk


@dataclass
class PrefillSegment:
    row: int  # first row of the chunk in the packed batch
    length: int
    start: int  # position of the first token
    context_slots: torch.Tensor  # [start + length] slots of every position so far


@dataclass
class ForwardBatch:
    """Metadata of one packed step, the same on every rank of a stage."""

    positions: torch.Tensor  # [T] absolute position of each token
    slot_mapping: torch.Tensor  # [T] where each token's K/V is written
    decode_rows: torch.Tensor  # [B] rows of single-token chunks
    decode_blocks: torch.Tensor  # [B * nblk] block ids of each decode's table (padded with 0)
    decode_mask: torch.Tensor  # [B, 1, 1, nblk * bs] True where a slot holds a real position
    prefills: list[PrefillSegment]
    kv: PagedKVCache
    cos: torch.Tensor | None = None  # [T, 1, D] rotary tables for ``positions``, set per step
    sin: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])

    @staticmethod
    def build(chunks: list[SeqChunk], kv: PagedKVCache) -> ForwardBatch:
        positions, slots, prefills = [], [], []
        decode_rows: list[int] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        bs = kv.block_size
        row = 0
        for c in chunks:
            n = len(c.token_ids)
            end = c.start_pos + n
            positions.append(torch.arange(c.start_pos, end))
            if n == 1:
                slots.append(kv.slots(c.seq_id, c.start_pos, end))
                decode_rows.append(row)
                decode_tables.append(kv.tables[c.seq_id][: -(-end // bs)])
                decode_lens.append(end)
            else:
                ctx = kv.slots(c.seq_id, 0, end)
                slots.append(ctx[c.start_pos :])
                prefills.append(PrefillSegment(row, n, c.start_pos, ctx.to(kv.device)))
            row += n
        nblk = max((len(t) for t in decode_tables), default=0)
        blocks = torch.tensor([t + [0] * (nblk - len(t)) for t in decode_tables], dtype=torch.int64)
        lengths = torch.tensor(decode_lens, dtype=torch.int64)
        mask = torch.arange(nblk * bs).unsqueeze(0) < lengths.unsqueeze(1)  # [B, nblk * bs]
        dev = kv.device
        return ForwardBatch(
            positions=torch.cat(positions).to(dev),
            slot_mapping=torch.cat(slots).to(dev),
            decode_rows=torch.tensor(decode_rows, dtype=torch.int64, device=dev),
            decode_blocks=blocks.reshape(-1).to(dev),
            decode_mask=mask[:, None, None, :].to(dev),
            prefills=prefills,
            kv=kv,
        )


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
        k_pool = batch.kv.k[self.layer_idx]  # [slots, nkv, D]
        v_pool = batch.kv.v[self.layer_idx]
        k_pool.index_copy_(0, batch.slot_mapping, k)
        v_pool.index_copy_(0, batch.slot_mapping, v)
        gqa = self.num_heads != self.num_kv_heads
        out = torch.empty_like(q)
        if batch.decode_rows.numel():
            b, bs = batch.decode_rows.shape[0], batch.kv.block_size
            nkv, hd = self.num_kv_heads, self.head_dim
            qd = q[batch.decode_rows].unsqueeze(2)  # (B, nh, 1, D)
            # whole blocks: (B * nblk, bs, nkv, D) -> (B, nkv, nblk * bs, D)
            kd = k_pool.view(-1, bs, nkv, hd).index_select(0, batch.decode_blocks)
            vd = v_pool.view(-1, bs, nkv, hd).index_select(0, batch.decode_blocks)
            kd = kd.view(b, -1, nkv, hd).transpose(1, 2)
            vd = vd.view(b, -1, nkv, hd).transpose(1, 2)
            if q.device.type == "cpu" and q.dtype != torch.float32:
                # CPU attention kernels run single-token queries ~4x slower in 16-bit
                # than in float32, conversions included
                qd, kd, vd = qd.float(), kd.float(), vd.float()
            od = F.scaled_dot_product_attention(
                qd, kd, vd, attn_mask=batch.decode_mask, scale=self.scale, enable_gqa=gqa
            )  # (B, nh, 1, D)
            out[batch.decode_rows] = od.squeeze(2).to(q.dtype)
        for seg in batch.prefills:
            rows = slice(seg.row, seg.row + seg.length)
            qp = q[rows].transpose(0, 1).unsqueeze(0)  # (1, nh, L, D)
            kp = k_pool[seg.context_slots].transpose(0, 1).unsqueeze(0)  # (1, nkv, S+L, D)
            vp = v_pool[seg.context_slots].transpose(0, 1).unsqueeze(0)
            mask = None
            if seg.start > 0:
                qpos = torch.arange(seg.length, device=q.device).unsqueeze(1) + seg.start
                mask = torch.arange(seg.start + seg.length, device=q.device).unsqueeze(0) <= qpos
            op = F.scaled_dot_product_attention(
                qp, kp, vp, attn_mask=mask, is_causal=seg.start == 0, scale=self.scale,
                enable_gqa=gqa,
            )  # fmt: skip  # (1, nh, L, D)
            out[rows] = op[0].transpose(0, 1)
        return out.reshape(out.shape[0], self.num_heads * self.head_dim)
