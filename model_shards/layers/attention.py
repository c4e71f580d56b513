"""Causal self-attention over packed sequences and a paged KV cache.

A step packs the new tokens of several sequences into one ``[T, ...]`` batch.
:class:`ForwardBatch` (built once per step, shared by all layers) says where
each new token's K/V goes (``slot_mapping``) and which slots each sequence
attends to. Single-token chunks (decodes) run as one batch; longer chunks
(prefill) run one by one with a causal mask offset by their start.
Grouped-query attention: ``nh`` query heads share ``nkv`` key/value heads.

On CPU in float32/bfloat16 the fused kernels (:mod:`model_shards.kernels`) apply
RoPE and write K/V in one pass, and decode attention reads the paged pool
directly; elsewhere the same math runs as PyTorch ops (a padded gather + SDPA).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from model_shards.kernels import use_cpu_kernels
from model_shards.kv_cache import PagedKVCache
from model_shards.layers.rotary import RotaryEmbedding, apply_rotary
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
    decode_tables: torch.Tensor  # [B, nblk] block ids of each decode's table (padded with 0)
    decode_lens: torch.Tensor  # [B] context length of each decode, its new token included
    prefills: list[PrefillSegment]
    kv: PagedKVCache
    rotary: RotaryEmbedding | None = None  # the model's tables, set per step
    _rope: tuple[torch.Tensor, torch.Tensor] | None = None
    _decode_mask: torch.Tensor | None = None

    @property
    def all_decodes(self) -> bool:
        return int(self.decode_rows.shape[0]) == self.num_tokens

    def rope_tables(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos, sin: [T, 1, D]`` for ``positions``, computed once per step for all layers."""
        if self._rope is None:
            assert self.rotary is not None
            self._rope = self.rotary.tables(self.positions, dtype)
        return self._rope

    def decode_mask(self) -> torch.Tensor:
        """``[B, 1, 1, nblk * bs]``: True where a padded decode slot holds a real position
        (the PyTorch decode path's mask), computed once per step for all layers."""
        if self._decode_mask is None:
            width = self.decode_tables.shape[1] * self.kv.block_size
            span = torch.arange(width, device=self.decode_lens.device)
            mask = span.unsqueeze(0) < self.decode_lens.unsqueeze(1)  # [B, nblk * bs]
            self._decode_mask = mask[:, None, None, :]
        return self._decode_mask

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])

    @staticmethod
    def build(chunks: list[SeqChunk], kv: PagedKVCache) -> ForwardBatch:
        # Python ints, one tensor each at the end: a decode row costs no tensor ops
        positions: list[int] = []
        slots: list[int] = []
        prefills: list[PrefillSegment] = []
        decode_rows: list[int] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        bs = kv.block_size
        row = 0
        for c in chunks:
            n = len(c.token_ids)
            end = c.start_pos + n
            positions.extend(range(c.start_pos, end))
            if n == 1:
                slots.append(kv.slot(c.seq_id, c.start_pos))
                decode_rows.append(row)
                decode_tables.append(kv.tables[c.seq_id][: -(-end // bs)])
                decode_lens.append(end)
            else:
                ctx = kv.slots(c.seq_id, 0, end)
                slots.extend(ctx[c.start_pos :].tolist())
                prefills.append(PrefillSegment(row, n, c.start_pos, ctx.to(kv.device)))
            row += n
        nblk = max((len(t) for t in decode_tables), default=0)
        tables = torch.tensor(
            [t + [0] * (nblk - len(t)) for t in decode_tables], dtype=torch.int64
        ).reshape(len(decode_tables), nblk)
        dev = kv.device
        return ForwardBatch(
            positions=torch.tensor(positions, dtype=torch.int64, device=dev),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            decode_rows=torch.tensor(decode_rows, dtype=torch.int64, device=dev),
            decode_tables=tables.to(dev),
            decode_lens=torch.tensor(decode_lens, dtype=torch.int64, device=dev),
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

    def forward(self, qkv: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """``qkv: [T, (nh + 2 nkv) * D]`` → ``[T, nh * D]``; writes this step's K/V."""
        k_pool = batch.kv.k[self.layer_idx]  # [slots, nkv, D]
        v_pool = batch.kv.v[self.layer_idx]
        fused = use_cpu_kernels(qkv) and qkv.stride(1) == 1
        q = self._rotary_and_cache(qkv, batch, k_pool, v_pool, fused)  # [T, nh, D]
        if batch.all_decodes:
            out = self._decode(q, batch, k_pool, v_pool, fused)
        else:
            out = torch.empty_like(q)
            if batch.decode_rows.numel():
                out[batch.decode_rows] = self._decode(
                    q[batch.decode_rows], batch, k_pool, v_pool, fused
                )
            for seg in batch.prefills:
                rows = slice(seg.row, seg.row + seg.length)
                out[rows] = self._prefill(q[rows], seg, k_pool, v_pool)
        return out.reshape(out.shape[0], self.num_heads * self.head_dim)

    def _rotary_and_cache(
        self, qkv: torch.Tensor, batch: ForwardBatch, k_pool: torch.Tensor,
        v_pool: torch.Tensor, fused: bool,
    ) -> torch.Tensor:  # fmt: skip
        """RoPE on q and k, K/V stored at ``slot_mapping``; returns ``q: [T, nh, D]``."""
        nh, nkv, t = self.num_heads, self.num_kv_heads, qkv.shape[0]
        if fused:
            assert batch.rotary is not None
            torch.ops.shardserve_cpu.rotary_and_cache(
                qkv, batch.positions, batch.rotary.cos_cached, batch.rotary.sin_cached, k_pool,
                v_pool, batch.slot_mapping, nh, nkv,
            )  # fmt: skip  # in place
            return qkv.view(t, -1, self.head_dim)[:, :nh]
        q, k, v = qkv.view(t, -1, self.head_dim).split([nh, nkv, nkv], dim=1)
        cos, sin = batch.rope_tables(qkv.dtype)
        q, k = apply_rotary(q, k, cos, sin)
        k_pool.index_copy_(0, batch.slot_mapping, k)
        v_pool.index_copy_(0, batch.slot_mapping, v)
        return q

    def _decode(
        self, q: torch.Tensor, batch: ForwardBatch, k_pool: torch.Tensor, v_pool: torch.Tensor,
        fused: bool,
    ) -> torch.Tensor:  # fmt: skip
        """Single-token queries ``q: [B, nh, D]`` over their whole context → ``[B, nh, D]``."""
        bs = batch.kv.block_size
        if fused:
            return torch.ops.shardserve_cpu.decode_attention(
                q, k_pool, v_pool, batch.decode_tables, batch.decode_lens, bs, self.scale
            )
        b, nkv, hd = q.shape[0], self.num_kv_heads, self.head_dim
        blocks = batch.decode_tables.reshape(-1)
        # whole blocks: (B * nblk, bs, nkv, D) -> (B, nkv, nblk * bs, D)
        kd = k_pool.view(-1, bs, nkv, hd).index_select(0, blocks).view(b, -1, nkv, hd)
        vd = v_pool.view(-1, bs, nkv, hd).index_select(0, blocks).view(b, -1, nkv, hd)
        qd, kd, vd = q.unsqueeze(2), kd.transpose(1, 2), vd.transpose(1, 2)  # (B, nh, 1, D)
        if q.device.type == "cpu" and q.dtype != torch.float32:
            # CPU attention kernels run single-token queries ~4x slower in 16-bit
            # than in float32, conversions included
            qd, kd, vd = qd.float(), kd.float(), vd.float()
        od = F.scaled_dot_product_attention(
            qd, kd, vd, attn_mask=batch.decode_mask(), scale=self.scale,
            enable_gqa=self.num_heads != nkv,
        )  # fmt: skip  # (B, nh, 1, D)
        return od.squeeze(2).to(q.dtype)

    def _prefill(
        self, q: torch.Tensor, seg: PrefillSegment, k_pool: torch.Tensor, v_pool: torch.Tensor
    ) -> torch.Tensor:
        """One chunk ``q: [L, nh, D]`` over its context (causal) → ``[L, nh, D]``."""
        qp = q.transpose(0, 1).unsqueeze(0)  # (1, nh, L, D)
        kp = k_pool[seg.context_slots].transpose(0, 1).unsqueeze(0)  # (1, nkv, S+L, D)
        vp = v_pool[seg.context_slots].transpose(0, 1).unsqueeze(0)
        mask = None
        if seg.start > 0:
            qpos = torch.arange(seg.length, device=q.device).unsqueeze(1) + seg.start
            mask = torch.arange(seg.start + seg.length, device=q.device).unsqueeze(0) <= qpos
        op = F.scaled_dot_product_attention(
            qp, kp, vp, attn_mask=mask, is_causal=seg.start == 0, scale=self.scale,
            enable_gqa=self.num_heads != self.num_kv_heads,
        )  # fmt: skip  # (1, nh, L, D)
        return op[0].transpose(0, 1)
