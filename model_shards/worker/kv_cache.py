"""Paged KV cache on a rank: a pool of fixed-size blocks per layer, and block tables.

Layout per layer: ``k, v: [num_blocks * block_size, nkv, D]`` — a flat array of
slots; slot ``b * block_size + i`` is token ``i`` of block ``b``. A sequence's
block table (kept in step with rank 0's by the plan's ``new_block_ids`` and
``freed_seq_ids``) maps position ``p`` to slot ``table[p // bs] * bs + p % bs``.
The pool is zero-filled so padded reads in batched decode are finite. With
``--kv-cache-dtype fp8`` the pools are ``float8_e4m3fn`` holding ``k / k_scale`` and
``v / v_scale`` (per-tensor scales of each layer, the checkpoint's or 1.0; ``cuda`` backend).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from model_shards.config.kv_layout import KVGroup, KVLayout
from model_shards.config.model import ModelConfig
from model_shards.messages import SeqChunk


@dataclass(frozen=True)
class KVPool:
    """One layer's paged K/V pools on this rank: ``k, v: [slots, nkv, D]``, slot
    ``b * block_size + i`` holding token ``i`` of block ``b`` (what the backends'
    attention ops read and write). FP8 pools hold ``k / k_scale`` and ``v / v_scale``."""

    k: torch.Tensor
    v: torch.Tensor
    block_size: int
    k_scale: float = 1.0
    v_scale: float = 1.0


class PagedKVCache:
    """A rank's K/V pools and block tables (one table per KV group and sequence).

    ``layout``: the model's KV groups (:mod:`model_shards.config.kv_layout`; default: one group,
    every layer its own buffer). Layers of different groups with the same slot share one
    buffer; ``pools[layer]`` is a layer's view, ``group_of[layer]`` its group.
    ``shared_kv`` (multi-head latent attention): one buffer per layer, ``v`` is ``k``.
    """

    def __init__(
        self,
        layers: range,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        layout: KVLayout | None = None,
        shared_kv: bool = False,
    ) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.layout = layout or KVLayout((KVGroup(None, tuple(layers)),))
        shape = (num_blocks * block_size, num_kv_heads, head_dim)
        slot = {i: self.layout.slot_of(i) for i in layers}
        k = {j: torch.zeros(shape, dtype=dtype, device=device) for j in set(slot.values())}
        v = k  # MLA: K and V are the one latent buffer
        if not shared_kv:
            v = {j: torch.zeros(shape, dtype=dtype, device=device) for j in set(slot.values())}
        self.k = {i: k[slot[i]] for i in layers}
        self.v = {i: v[slot[i]] for i in layers}
        self.pools = {i: KVPool(self.k[i], self.v[i], block_size) for i in layers}
        self.group_of = {i: self.layout.group_of(i) for i in layers}
        self.tables: dict[int, list[int]] = {}  # group 0's
        self.window_tables: list[dict[int, list[int]]] = [
            {} for _ in range(self.layout.num_groups - 1)
        ]
        self.device = device
        # host-built step metadata goes through pinned memory where the device queues work, so
        # its copy never waits for the steps queued before it (async scheduling)
        self._pinned = device.type == "cuda"

    def to_device(self, values: list[int] | torch.Tensor) -> torch.Tensor:
        """Host ints (a list, or an int64 CPU tensor) on the pool's device, copied without
        waiting for the work already queued there."""
        host = (
            values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=torch.int64)
        )
        if self._pinned:
            return host.pin_memory().to(self.device, non_blocking=True)
        return host.to(self.device)

    @staticmethod
    def for_stage(
        cfg: ModelConfig,
        layers: range,
        tp_size: int,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> PagedKVCache:
        """The pool of one stage's ``layers`` of ``cfg`` on a rank of a ``tp_size`` group
        (``max(1, nkv / tp)`` KV heads: replicated when tp exceeds them), in the model's
        KV layout."""
        nkv = cfg.kv_heads_per_rank(tp_size)
        layout = KVLayout.for_model(cfg)
        return PagedKVCache(
            layers, num_blocks, block_size, nkv, cfg.head_dim, dtype, device, layout, cfg.kv_latent
        )

    def set_kv_scales(self, layer: int, k_scale: float, v_scale: float) -> None:
        """Layer ``layer``'s per-tensor K/V scales of an FP8 pool (the checkpoint's
        ``k_scale``/``v_scale``), set after loading and before the first step."""
        if not (k_scale > 0 and v_scale > 0):
            raise ValueError(f"layer {layer}: KV scales must be positive, got {k_scale}, {v_scale}")
        self.pools[layer] = replace(self.pools[layer], k_scale=k_scale, v_scale=v_scale)

    def group_tables(self, group: int) -> dict[int, list[int]]:
        """Block tables of KV group ``group`` by sequence id."""
        return self.tables if group == 0 else self.window_tables[group - 1]

    def free(self, seq_id: int) -> None:
        self.tables.pop(seq_id, None)
        for tables in self.window_tables:
            tables.pop(seq_id, None)

    def extend_tables(self, chunks: list[SeqChunk]) -> None:
        for chunk in chunks:
            cut = chunk.table_len  # >= 0: blocks of rolled-back drafts leave first
            for tables, new in (
                (self.tables, chunk.new_block_ids),
                *zip(self.window_tables, chunk.window_block_ids, strict=True),
            ):
                table = tables.setdefault(chunk.seq_id, [])
                if cut >= 0:
                    del table[cut:]
                table.extend(new)

    def _table_through(self, seq_id: int, last_position: int, group: int) -> list[int]:
        """``seq_id``'s block table of ``group``, checked to reach ``last_position``."""
        table = self.group_tables(group)[seq_id]
        if last_position // self.block_size >= len(table):
            raise RuntimeError(
                f"sequence {seq_id}: block table too short for position {last_position}"
            )
        return table

    def table_prefix(self, seq_id: int, length: int, group: int = 0) -> list[int]:
        """The blocks of ``seq_id``'s table (of KV group ``group``) that hold positions
        ``0 .. length - 1``."""
        return self.group_tables(group)[seq_id][: -(-length // self.block_size)]

    def slot(self, seq_id: int, position: int, group: int = 0) -> int:
        """Slot of one position of ``seq_id`` (a decode step's, without building tensors)."""
        table = self._table_through(seq_id, position, group)
        return table[position // self.block_size] * self.block_size + position % self.block_size

    def slot_list(self, seq_id: int, start: int, end: int, group: int = 0) -> list[int]:
        """Slot of every position ``start..end-1`` of ``seq_id``, as Python ints."""
        table = self._table_through(seq_id, end - 1, group)
        bs = self.block_size
        return [table[p // bs] * bs + p % bs for p in range(start, end)]
