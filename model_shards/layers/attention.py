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

from model_shards.backends.base import Backend, DecodeMeta, HeadNorms, PrefillMeta, RotaryStep
from model_shards.layers.rotary import RotaryEmbedding
from model_shards.messages import SeqChunk
from model_shards.worker.kv_cache import KVPool, PagedKVCache


def _padded(tables: list[list[int]]) -> torch.Tensor:
    """Block tables of unequal lengths as one ``[N, nblk]`` int64 tensor, padded with 0."""
    width = max((len(t) for t in tables), default=0)
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int64).reshape(
        len(tables), width
    )


@dataclass(frozen=True)
class GroupMeta:
    """One KV group's view of a step (:mod:`model_shards.config.kv_layout`): where each token's
    K/V goes in that group's blocks, and the decode and prefill block tables."""

    slot_mapping: torch.Tensor  # [T] (< 0: padding)
    decode: DecodeMeta
    prefill: PrefillMeta | None


@dataclass
class ForwardBatch:
    """Metadata of one packed step, the same on every rank of a stage.

    ``slot_mapping``, ``decode`` and ``prefill`` are KV group 0's; ``windows`` the
    other groups' (:class:`GroupMeta`, empty for a model with one group)."""

    positions: torch.Tensor  # [T] absolute position of each token
    slot_mapping: torch.Tensor  # [T] where each token's K/V is written (< 0: padding)
    decode_rows: torch.Tensor  # [B] rows of single-token chunks
    decode: DecodeMeta  # their block tables [B, nblk] and context lengths [B]
    prefill: PrefillMeta | None  # the multi-token chunks, None when there are none
    kv: PagedKVCache
    rotary: RotaryEmbedding | None = None  # the model's tables, set per step
    windows: list[GroupMeta] = field(default_factory=list)
    # per-token rotary rows ``(cos, sin)``, each ``[T, D]`` float32, used instead of the
    # tables' rows at ``positions`` (a model whose positions are not one stream: M-RoPE,
    # ``models/qwen2_5_vl_positions.py``); set by the worker from the model's hook
    rotary_rows: tuple[torch.Tensor, torch.Tensor] | None = None
    _rotary_steps: dict[tuple[int, int], RotaryStep] = field(default_factory=dict, repr=False)

    def group(self, g: int) -> GroupMeta:
        """KV group ``g``'s slots and block tables for this step."""
        if g == 0:
            return GroupMeta(self.slot_mapping, self.decode, self.prefill)
        return self.windows[g - 1]

    def rotary_step(self, group: int = 0, rotary: RotaryEmbedding | None = None) -> RotaryStep:
        """Positions, rotary tables (``rotary``, else the model's) and K/V slots of KV group
        ``group`` for this step (made once, for every layer that reads them)."""
        tables = rotary or self.rotary
        assert tables is not None, "the model sets the batch's rotary tables"
        key = (group, id(tables))
        if key not in self._rotary_steps:
            slots = self.group(group).slot_mapping
            cos, sin = tables.cos_cached, tables.sin_cached
            positions = self.positions
            if self.rotary_rows is not None:  # row i of the step's own tables: token i
                cos, sin = self.rotary_rows
                positions = torch.arange(self.num_tokens, device=positions.device)
            self._rotary_steps[key] = RotaryStep(positions, cos, sin, slots)
        return self._rotary_steps[key]

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])

    @staticmethod
    def build(chunks: list[SeqChunk], kv: PagedKVCache) -> ForwardBatch:
        # Python ints, one tensor each at the end: a decode row costs no tensor ops
        positions: list[int] = []
        decode_rows: list[int] = []
        decode_lens: list[int] = []
        prefill_rows: list[int] = []
        prefill_lens: list[int] = []
        prefill_starts: list[int] = []
        groups = [_GroupLists() for _ in range(kv.layout.num_groups)]
        row = 0
        for c in chunks:
            n = len(c.token_ids)
            end = c.start_pos + n
            positions.extend(range(c.start_pos, end))
            if n == 1 or c.num_draft:  # a verify chunk's rows attend as decodes do, one each
                decode_rows.extend(range(row, row + n))
                decode_lens.extend(range(c.start_pos + 1, end + 1))
            else:
                prefill_rows.append(row)
                prefill_lens.append(n)
                prefill_starts.append(c.start_pos)
            for g, lists in enumerate(groups):
                lists.add(kv, g, c, end)
            row += n
        shared = _StepShape(
            decode_lens, max(decode_lens, default=0), prefill_rows, prefill_lens, prefill_starts
        )
        metas = [
            lists.meta(shared, kv, window)
            for lists, window in zip(groups, kv.layout.windows, strict=True)
        ]
        return ForwardBatch(
            positions=kv.to_device(positions),
            slot_mapping=metas[0].slot_mapping,
            decode_rows=kv.to_device(decode_rows),
            decode=metas[0].decode,
            prefill=metas[0].prefill,
            kv=kv,
            windows=metas[1:],
        )


@dataclass(frozen=True)
class _StepShape:
    """What every KV group's metadata of a step shares: the chunks' lengths and starts."""

    decode_lens: list[int]
    max_decode_len: int
    prefill_rows: list[int]
    prefill_lens: list[int]
    prefill_starts: list[int]


@dataclass
class _GroupLists:
    """One KV group's slots and block tables of a step, as Python ints while it is built."""

    slots: list[int] = field(default_factory=list)
    decode_tables: list[list[int]] = field(default_factory=list)
    prefill_tables: list[list[int]] = field(default_factory=list)

    def add(self, kv: PagedKVCache, group: int, chunk: SeqChunk, end: int) -> None:
        table = kv.table_prefix(chunk.seq_id, end, group)
        if end - chunk.start_pos == 1:
            self.slots.append(kv.slot(chunk.seq_id, chunk.start_pos, group))
            self.decode_tables.append(table)
        elif chunk.num_draft:  # speculative verify: one decode row per position
            self.slots.extend(kv.slot_list(chunk.seq_id, chunk.start_pos, end, group))
            for p in range(chunk.start_pos + 1, end + 1):
                self.decode_tables.append(kv.table_prefix(chunk.seq_id, p, group))
        else:
            self.slots.extend(kv.slot_list(chunk.seq_id, chunk.start_pos, end, group))
            self.prefill_tables.append(table)

    def meta(self, shape: _StepShape, kv: PagedKVCache, window: int | None) -> GroupMeta:
        """The group's metadata on ``kv``'s device (copies that wait for no queued work)."""
        prefill = None
        if shape.prefill_rows:
            prefill = PrefillMeta(
                q_starts=kv.to_device(shape.prefill_rows),
                q_lens=kv.to_device(shape.prefill_lens),
                start_positions=kv.to_device(shape.prefill_starts),
                block_tables=kv.to_device(_padded(self.prefill_tables)),
                q_starts_list=shape.prefill_rows,
                q_lens_list=shape.prefill_lens,
                start_positions_list=shape.prefill_starts,
                block_size=kv.block_size,
                window=window,
            )
        decode = DecodeMeta(
            kv.to_device(_padded(self.decode_tables)),
            kv.to_device(shape.decode_lens),
            shape.max_decode_len,
            window,
        )
        return GroupMeta(kv.to_device(self.slots), decode, prefill)


def paged_attention(
    ops: Backend,
    q: torch.Tensor,
    pool: KVPool,
    meta: GroupMeta,
    decode_rows: torch.Tensor,
    scale: float,
    softcap: float | None = None,
) -> torch.Tensor:
    """``q [T, nh, D]`` (this step's K/V already in ``pool``) → ``[T, nh, D]``: the decode
    rows (``decode_rows``, single-token chunks) as one batched decode call, the prefill
    chunks as one varlen prefill call. ``softcap``: see :class:`Attention`."""
    if meta.prefill is None:
        return ops.decode_attention(q, pool, meta.decode, scale, softcap)
    out = torch.empty_like(q)  # [T, nh, D]
    if decode_rows.numel():
        out[decode_rows] = ops.decode_attention(q[decode_rows], pool, meta.decode, scale, softcap)
    ops.prefill_attention(q, pool, meta.prefill, scale, out, softcap)
    return out


class Attention(nn.Module):
    """Paged attention of one layer. ``scale``: the score scale (``head_dim ** -0.5`` by
    default); ``softcap``: scores squashed to ``softcap * tanh(s / softcap)`` before the
    mask and softmax (Gemma 2), ``None`` for none; ``rotary``: this layer's own RoPE
    tables (Gemma 3's sliding layers), else the model's. The window, if any, is the
    layer's KV group's (:mod:`model_shards.config.kv_layout`), in the step's metadata."""

    def __init__(
        self,
        layer_idx: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        ops: Backend,
        *,
        scale: float | None = None,
        softcap: float | None = None,
        rotary: RotaryEmbedding | None = None,
    ) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5 if scale is None else scale
        self.softcap = softcap
        self.rotary = rotary
        self.ops = ops

    def forward(
        self, qkv: torch.Tensor, batch: ForwardBatch, norms: HeadNorms | None = None
    ) -> torch.Tensor:
        """``qkv: [T, (nh + 2 nkv) * D]`` → ``[T, nh * D]``; writes this step's K/V.
        ``norms``: per-head q/k RMSNorms applied before RoPE, in the same backend call."""
        pool = batch.kv.pools[self.layer_idx]  # [slots, nkv, D] each
        group = batch.kv.group_of[self.layer_idx]
        heads = (self.num_heads, self.num_kv_heads)
        step = batch.rotary_step(group, self.rotary)
        q = self.ops.rotary_and_cache(qkv, step, pool, heads, norms)  # [T, nh, D]
        meta = batch.group(group)
        out = paged_attention(self.ops, q, pool, meta, batch.decode_rows, self.scale, self.softcap)
        return out.reshape(out.shape[0], self.num_heads * self.head_dim)
