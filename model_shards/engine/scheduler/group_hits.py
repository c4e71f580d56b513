"""Prefix-cache hits over several KV groups (sliding-window models).

Every KV group caches its own blocks, under the block's chained hash tagged with the group
(:func:`group_hash`; group 0's is the plain hash). A hit of ``h`` full blocks lets the
sequence start computing at position ``h * block_size``; each group must then hold the
blocks its layers can still read from there: a whole-context group all ``h``, a windowed
group only those of the window before that position (its earlier entries stay ``-1``).
The hit is the longest ``h`` every group can serve.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from model_shards.config.kv_layout import window_start
from model_shards.engine.scheduler.block_manager import BlockManager
from model_shards.engine.scheduler.prefix_cache import BlockHash


def group_hash(group: int, block_hash: BlockHash) -> BlockHash:
    """The cache key of a block of KV group ``group`` (group 0: the hash itself)."""
    if group == 0:
        return block_hash
    return hashlib.sha256(b"kv-group-%d:" % group + block_hash).digest()


def cached_tables(
    blocks: BlockManager,
    hashes: Sequence[BlockHash],
    windows: Sequence[int | None],
    block_size: int,
) -> list[list[int]]:
    """Per group, the leading table a hit gives (``-1``: an entry outside the window),
    for the longest hit over ``hashes`` that every group of ``windows`` can serve;
    empty tables for no hit. Nothing is acquired."""
    if not blocks.enable_caching:
        return [[] for _ in windows]
    longest = len(blocks.cached_prefix(hashes))  # group 0's hashes are the plain ones
    for h in range(longest, 0, -1):
        tables = _tables_for(blocks, hashes, windows, block_size, h)
        if tables is not None:
            return tables
    return [[] for _ in windows]


def _tables_for(
    blocks: BlockManager,
    hashes: Sequence[BlockHash],
    windows: Sequence[int | None],
    block_size: int,
    h: int,
) -> list[list[int]] | None:
    """Every group's table for a hit of ``h`` blocks, or ``None`` if a group lacks one."""
    tables = []
    for g, window in enumerate(windows):
        first = window_start(window, h * block_size) // block_size
        ids = [blocks.cache.lookup(group_hash(g, hashes[i])) for i in range(first, h)]
        if any(b is None for b in ids):
            return None
        tables.append([-1] * first + [b for b in ids if b is not None])
    return tables
