"""Causal self-attention over packed sequences and a paged KV cache.

A step packs the new tokens of several sequences into one ``[T, ...]`` batch.
:class:`ForwardBatch` (built once per step, shared by all layers) says where
each new token's K/V goes (``slot_mapping``) and, through block tables, which
slots each sequence attends to. Single-token chunks (decodes) run as one batched
decode-attention call; longer chunks (prefill) as one varlen prefill call
(:class:`~model_shards.backends.base.PrefillMeta`). Grouped-query attention:
``nh`` query heads share ``nkv`` key/value heads. The backend does the work:
RoPE fused with the K/V write, attention read straight from the paged pool where
it has kernels for it (the reference backend gathers the blocks).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from model_shards.backends.base import Backend, DecodeMeta, PrefillMeta, RotaryStep
from model_shards.kv_cache import PagedKVCache
from model_shards.layers.rotary import RotaryEmbedding
from model_shards.messages import SeqChunk


def _padded(tables: list[list[int]]) -> torch.Tensor:
    """Block tables of unequal lengths as one ``[N, nblk]`` int64 tensor, padded with 0."""
    width = max((len(t) for t in tables), default=0)
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int64).reshape(
        len(tables), width
    )


@dataclass
class ForwardBatch:
    """Metadata of one packed step, the same on every rank of a stage."""

    positions: torch.Tensor  # [T] absolute position of each token
    slot_mapping: torch.Tensor  # [T] where each token's K/V is written (< 0: padding)
    decode_rows: torch.Tensor  # [B] rows of single-token chunks
    decode: DecodeMeta  # their block tables [B, nblk] and context lengths [B]
    prefill: PrefillMeta | None  # the multi-token chunks, None when there are none
    kv: PagedKVCache
    rotary: RotaryEmbedding | None = None  # the model's tables, set per step
    _rotary_step: RotaryStep | None = field(default=None, repr=False)

    def rotary_step(self) -> RotaryStep:
        """Positions, rotary tables and K/V slots of the step (made once, for every layer)."""
        if self._rotary_step is None:
            assert self.rotary is not None, "the model sets the batch's rotary tables"
            tables = self.rotary.cos_cached, self.rotary.sin_cached
            self._rotary_step = RotaryStep(self.positions, *tables, self.slot_mapping)
        return self._rotary_step

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])

    @staticmethod
    def build(chunks: list[SeqChunk], kv: PagedKVCache) -> ForwardBatch:
        # Python ints, one tensor each at the end: a decode row costs no tensor ops
        positions: list[int] = []
        slots: list[int] = []
        decode_rows: list[int] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        prefill_rows: list[int] = []
        prefill_lens: list[int] = []
        prefill_starts: list[int] = []
        prefill_tables: list[list[int]] = []
        bs = kv.block_size
        row = 0
        for c in chunks:
            n = len(c.token_ids)
            end = c.start_pos + n
            positions.extend(range(c.start_pos, end))
            table = kv.table_prefix(c.seq_id, end)
            if n == 1:
                slots.append(kv.slot(c.seq_id, c.start_pos))
                decode_rows.append(row)
                decode_tables.append(table)
                decode_lens.append(end)
            else:
                slots.extend(kv.slot_list(c.seq_id, c.start_pos, end))
                prefill_rows.append(row)
                prefill_lens.append(n)
                prefill_starts.append(c.start_pos)
                prefill_tables.append(table)
            row += n
        dev = kv.device
        prefill = None
        if prefill_rows:
            prefill = PrefillMeta(
                q_starts=torch.tensor(prefill_rows, dtype=torch.int64, device=dev),
                q_lens=torch.tensor(prefill_lens, dtype=torch.int64, device=dev),
                start_positions=torch.tensor(prefill_starts, dtype=torch.int64, device=dev),
                block_tables=_padded(prefill_tables).to(dev),
                q_starts_list=prefill_rows,
                q_lens_list=prefill_lens,
                start_positions_list=prefill_starts,
                block_size=bs,
            )
        return ForwardBatch(
            positions=torch.tensor(positions, dtype=torch.int64, device=dev),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            decode_rows=torch.tensor(decode_rows, dtype=torch.int64, device=dev),
            decode=DecodeMeta(
                _padded(decode_tables).to(dev),
                torch.tensor(decode_lens, dtype=torch.int64, device=dev),
                max(decode_lens, default=0),
            ),
            prefill=prefill,
            kv=kv,
        )


class Attention(nn.Module):
    def __init__(
        self, layer_idx: int, num_heads: int, num_kv_heads: int, head_dim: int, ops: Backend
    ) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        self.ops = ops

    def forward(self, qkv: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """``qkv: [T, (nh + 2 nkv) * D]`` → ``[T, nh * D]``; writes this step's K/V."""
        pool = batch.kv.pools[self.layer_idx]  # [slots, nkv, D] each
        heads = (self.num_heads, self.num_kv_heads)
        q = self.ops.rotary_and_cache(qkv, batch.rotary_step(), pool, heads)  # [T, nh, D]
        if batch.prefill is None:
            out = self.ops.decode_attention(q, pool, batch.decode, self.scale)
        else:
            out = torch.empty_like(q)  # [T, nh, D]
            if batch.decode_rows.numel():
                rows = batch.decode_rows
                out[rows] = self.ops.decode_attention(q[rows], pool, batch.decode, self.scale)
            self.ops.prefill_attention(q, pool, batch.prefill, self.scale, out)
        return out.reshape(out.shape[0], self.num_heads * self.head_dim)
