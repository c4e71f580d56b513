"""Content addressing of full KV blocks, and the LRU set of blocks nobody holds.

A full block is named by ``sha256(parent_digest || tokens)`` (tokens as little-endian int64,
the previous block's digest empty for the first): equal hashes mean equal *prefixes*, in every
process and run. SHA-256 makes a collision, which would serve another prompt's KV, negligible.

One :class:`PrefixCache` serves every KV group (:func:`.group_hits.group_hash` tags the keys of
groups ``g > 0``). A cached block nobody holds is *parked*: reusable by a hit, evicted least
recently released first. Reference counts live in :class:`.block_manager.BlockManager`.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Sequence

BlockHash = bytes


def hash_block(parent: BlockHash | None, tokens: Sequence[int], extra: bytes = b"") -> BlockHash:
    """The chained hash of one full block; ``extra`` (hashed after the tokens): what else its
    K/V depends on, the hashes of images whose placeholders it holds."""
    h = hashlib.sha256(parent or b"")
    h.update(struct.pack(f"<{len(tokens)}q", *tokens))
    h.update(extra)
    return h.digest()


class PrefixCache:
    """Hash ↔ block id for computed full blocks, plus the LRU of parked ones."""

    def __init__(self) -> None:
        self._block_of: dict[BlockHash, int] = {}
        self._hash_of: dict[int, BlockHash] = {}
        self._parked: OrderedDict[int, None] = OrderedDict()  # oldest release first

    def __len__(self) -> int:
        """Blocks currently cached (held or parked)."""
        return len(self._hash_of)

    @property
    def num_parked(self) -> int:
        return len(self._parked)

    def lookup(self, block_hash: BlockHash) -> int | None:
        return self._block_of.get(block_hash)

    def is_cached(self, block: int) -> bool:
        return block in self._hash_of

    def is_parked(self, block: int) -> bool:
        return block in self._parked

    def insert(self, block: int, block_hash: BlockHash) -> bool:
        """Name ``block`` by ``block_hash``; ``False`` (nothing changes) if either is taken."""
        if block_hash in self._block_of or block in self._hash_of:
            return False
        self._block_of[block_hash] = block
        self._hash_of[block] = block_hash
        return True

    def park(self, block: int) -> None:
        """A cached block lost its last holder: most recently released, evicted last."""
        self._parked[block] = None

    def unpark(self, block: int) -> None:
        """A parked block is held again (a prefix-cache hit)."""
        del self._parked[block]

    def evict(self) -> int | None:
        """Forget the least recently released parked block and return it, or ``None``."""
        if not self._parked:
            return None
        block, _ = self._parked.popitem(last=False)
        del self._block_of[self._hash_of.pop(block)]
        return block

    def parked_in_lru_order(self) -> list[int]:
        """Parked blocks, next to be evicted first (for tests and debugging)."""
        return list(self._parked)
