"""What every part of the scheduler reads and changes: the KV pool, the queues, the counters."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator

from model_shards.config.kv_layout import window_start
from model_shards.config.scheduler import SchedulerConfig, SchedulerStats
from model_shards.engine.scheduler.block_manager import BlockManager
from model_shards.engine.scheduler.group_hits import group_hash
from model_shards.engine.scheduler.lora_slots import LoraSlots
from model_shards.engine.scheduler.sequence import Ahead, SeqStatus, Sequence
from model_shards.engine.scheduler.stats import SchedulerCounters
from model_shards.engine.scheduler.step_builder import StepBuilder


class SchedulerState:
    """Rank 0's record of every live sequence and of the paged KV pool.

    ``waiting``: sequences not on the ranks (new, or preempted), in the order they are
    served (:meth:`enqueue`): first come first served, a preempted one at the front; under
    the ``priority`` policy by (``priority``, arrival). ``running``: on the ranks and
    holding blocks, in admission order (oldest first). ``by_request``: every live sequence by
    request id. ``in_flight``: ids of sequences in a scheduled step that is not
    updated yet; they are neither scheduled nor preempted (async scheduling runs some ahead of
    their chunk in flight, ``ahead``: :mod:`.ahead`). ``to_free``: ids of
    retired sequences the ranks have not been told about yet.
    """

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.blocks = BlockManager(
            config.num_blocks, config.block_size, config.enable_prefix_caching
        )
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.by_request: dict[str, Sequence] = {}
        self.in_flight: set[int] = set()
        self.ahead: dict[int, Ahead] = {}  # async scheduling: what the next step may follow
        self.to_free: list[int] = []
        self.counters = SchedulerCounters()
        self.lora_slots = LoraSlots(config.max_loras)

    def enqueue(self, seq: Sequence, preempted: bool = False) -> None:
        """Put ``seq`` into ``waiting``: at the back (new) or the front (preempted), or under
        the ``priority`` policy before the first sequence that ranks after it (lower
        ``priority`` first, then the earlier arrival: a sequence id)."""
        if self.config.scheduling_policy != "priority":
            (self.waiting.appendleft if preempted else self.waiting.append)(seq)
            return
        key, queue = priority_rank(seq), self.waiting
        at = next((i for i, s in enumerate(queue) if priority_rank(s) > key), len(queue))
        queue.insert(at, seq)

    def victims(self, step: StepBuilder) -> Iterator[Sequence]:
        """Running sequences that may be preempted for room, the first to go first: not in
        ``step`` nor in an unfinished step; the newest admitted, or under the ``priority``
        policy the one that ranks last (highest ``priority``, then the latest arrival)."""
        order: Iterable[Sequence] = reversed(self.running)
        if self.config.scheduling_policy == "priority":
            order = sorted(self.running, key=priority_rank, reverse=True)
        busy = step.scheduled | self.in_flight
        return (s for s in order if s.seq_id not in busy)

    def take_freed(self) -> list[int]:
        """The ids retired since the last call (they go out with the next step)."""
        freed, self.to_free = self.to_free, []
        return freed

    def ready(self, seq: Sequence, step: StepBuilder) -> bool:
        """Whether ``seq`` runs, is not in ``step`` yet, and is in no unfinished step."""
        return (
            seq.status is SeqStatus.RUNNING
            and seq.seq_id not in step.scheduled
            and seq.seq_id not in self.in_flight
        )

    def extend_and_add(
        self, seq: Sequence, end: int, step: StepBuilder, drafts: list[int] | None = None
    ) -> None:
        """Grow a running sequence's block tables (one per KV group) to cover ``end``
        tokens; add its chunk (ending with ``drafts``, if any)."""
        new_blocks, window_blocks = self.extend(seq, seq.num_computed, end)
        step.add(seq, seq.num_computed, end, new_blocks, window_blocks, drafts)

    def extend(self, seq: Sequence, start: int, end: int) -> tuple[list[int], list[list[int]]]:
        """Grow every block table of ``seq`` to cover ``end`` tokens for a chunk from ``start``
        (its prompt positions counted as prefill): the ids added to group 0's, and to 1..'s."""
        self.counters.prefill_tokens += max(0, min(end, seq.prefill_end) - start)
        n = self.blocks.blocks_for(end) - len(seq.block_table)
        new_blocks = self.blocks.allocate(n)
        seq.block_table.extend(new_blocks)
        window_blocks = [self.blocks.allocate(n) for _ in seq.window_tables]
        for table, new in zip(seq.window_tables, window_blocks, strict=True):
            table.extend(new)
        return new_blocks, window_blocks

    def blocks_to_extend(self, seq: Sequence, end: int) -> int:
        """Block ids growing every table of ``seq`` to cover ``end`` tokens takes."""
        groups = self.config.num_kv_groups
        return groups * max(0, self.blocks.blocks_for(end) - len(seq.block_table))

    def release_outside_windows(self, seq: Sequence) -> None:
        """Release the blocks of ``seq``'s windowed tables that no query from
        ``num_computed`` on can attend to (entry ``-1``); the ranks keep their stale
        ids, which every windowed read skips."""
        bs = self.config.block_size
        for window, table in zip(self.config.kv_windows, self.tables(seq), strict=True):
            dead = window_start(window, seq.num_computed) // bs  # blocks wholly before it
            for i in range(min(dead, len(table))):
                if table[i] >= 0:
                    self.blocks.release([table[i]])
                    table[i] = -1

    @staticmethod
    def tables(seq: Sequence) -> list[list[int]]:
        """Every KV group's block table of ``seq``, group 0 first."""
        return [seq.block_table, *seq.window_tables]

    def register_computed_blocks(self, seq: Sequence) -> None:
        """Offer the sequence's newly computed full blocks, every KV group's, to the prefix
        cache (a windowed group's blocks already released are skipped)."""
        if not self.blocks.enable_caching:
            return
        bs = self.config.block_size
        full = seq.num_computed // bs
        hashes = seq.block_hashes(full, bs)
        for g, table in enumerate(self.tables(seq)):
            for i in range(seq.num_registered_blocks, full):
                if table[i] >= 0:
                    self.blocks.register(table[i], group_hash(g, hashes[i]))
        seq.num_registered_blocks = max(seq.num_registered_blocks, full)

    def roll_back(self, seq: Sequence) -> None:
        """Release the blocks of ``seq``'s tables past ``num_computed`` (they held only
        rejected drafts, never cached); the ranks cut their tables with its next chunk."""
        keep = self.blocks.blocks_for(seq.num_computed)
        if len(seq.block_table) <= keep:
            return
        for table in reversed(self.tables(seq)):
            self.blocks.release(b for b in reversed(table[keep:]) if b >= 0)
            del table[keep:]
        seq.table_cut = keep

    def retire(self, seq: Sequence) -> None:
        """A running sequence is done (finished or aborted): release (blocks, adapter slot) and
        forget it."""
        self.running.remove(seq)
        self.release_blocks(seq)
        del self.by_request[seq.request_id]
        self.to_free.append(seq.seq_id)
        seq.status = SeqStatus.FINISHED

    def release_blocks(self, seq: Sequence) -> None:
        """Give back every block of ``seq``'s table (cached ones stay parked)."""
        # Tail first, so a sequence's deepest cached blocks are evicted before its
        # shared-prefix blocks (an evicted parent would make its children unreachable).
        for table in reversed(self.tables(seq)):
            self.blocks.release(b for b in reversed(table) if b >= 0)
        seq.block_table = []
        seq.window_tables = []
        if seq.lora_slot >= 0:  # off the ranks: its adapter's slot may go to another
            self.lora_slots.release(seq.lora_slot)
            seq.lora_slot = -1

    def stats(self) -> SchedulerStats:
        """The counters so far, and the pool and queues as they are now."""
        counters = self.counters
        return SchedulerStats(
            prefill_tokens_computed=counters.prefill_tokens,
            prefix_cache_hit_tokens=counters.hit_tokens,
            num_preemptions=counters.preemptions,
            num_free_blocks=self.blocks.num_free,
            num_cached_blocks=len(self.blocks.cache),
            num_blocks=self.config.num_blocks,
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            spec=counters.spec.snapshot(),
        )


def priority_rank(seq: Sequence) -> tuple[int, int]:
    """Where ``seq`` stands under the ``priority`` policy: lower first."""
    return seq.request.priority, seq.seq_id
