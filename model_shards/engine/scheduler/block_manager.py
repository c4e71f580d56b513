"""The paged KV pool on rank 0: which block ids are free, held, or cached.

Block ids are ``0 .. num_blocks - 1``; the ranks own the memory, rank 0 only
the bookkeeping. A block is in exactly one state:

* **free**: no content worth keeping; handed out first;
* **held**: reference count ``>= 1`` (by running sequences' block tables);
* **parked**: reference count 0 but cached (see :mod:`.prefix_cache`);
  reusable by a cache hit, or evicted (LRU) when no free block is left.

``num_free`` counts free + parked blocks: everything :meth:`allocate` may hand out.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from model_shards.engine.scheduler.prefix_cache import BlockHash, PrefixCache


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.cache = PrefixCache()
        self._free: deque[int] = deque(range(num_blocks))
        self._refs = [0] * num_blocks

    @property
    def num_free(self) -> int:
        """Blocks :meth:`allocate` can hand out now (free, then evicted from the cache)."""
        return len(self._free) + self.cache.num_parked

    def ref_count(self, block: int) -> int:
        return self._refs[block]

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks a table needs to cover positions ``0 .. num_tokens - 1``."""
        return -(-num_tokens // self.block_size)

    def allocate(self, n: int) -> list[int]:
        """``n`` fresh blocks, each held once. ``RuntimeError`` if fewer are available."""
        if n > self.num_free:
            raise RuntimeError(f"asked for {n} KV blocks, {self.num_free} available")
        out = []
        for _ in range(n):
            block = self._free.popleft() if self._free else self.cache.evict()
            assert block is not None  # num_free counted it
            self._refs[block] = 1
            out.append(block)
        return out

    def cached_prefix(self, hashes: Iterable[BlockHash]) -> list[int]:
        """Block ids of the longest run of leading ``hashes`` that are cached (not acquired)."""
        if not self.enable_caching:
            return []
        blocks = []
        for h in hashes:
            block = self.cache.lookup(h)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def num_parked_among(self, blocks: Iterable[int]) -> int:
        """How many of ``blocks`` acquiring would take out of ``num_free``."""
        return sum(1 for b in blocks if self.cache.is_parked(b))

    def acquire(self, blocks: Iterable[int]) -> None:
        """Hold cached ``blocks`` once more (a prefix-cache hit)."""
        for block in blocks:
            if self._refs[block] == 0:
                self.cache.unpark(block)
            self._refs[block] += 1

    def release(self, blocks: Iterable[int]) -> None:
        """Drop one hold on each of ``blocks``, in the given order.

        Blocks reaching 0 are parked if cached (later ones are evicted later),
        else returned to the free list.
        """
        for block in blocks:
            if self._refs[block] <= 0:
                raise RuntimeError(f"KV block {block} released more often than held")
            self._refs[block] -= 1
            if self._refs[block] == 0:
                if self.cache.is_cached(block):
                    self.cache.park(block)
                else:
                    self._free.append(block)

    def register(self, block: int, block_hash: BlockHash) -> None:
        """Offer a held block whose tokens are now computed to the prefix cache.

        A no-op when caching is off, or when the same content is already cached
        under another block (that duplicate then goes back to the free list).
        """
        if self.enable_caching and self._refs[block] > 0:
            self.cache.insert(block, block_hash)
