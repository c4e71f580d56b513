"""What every part of the scheduler reads and changes: the KV pool, the queues, the counters."""

from __future__ import annotations

from collections import deque

from model_shards.scheduler.block_manager import BlockManager
from model_shards.scheduler.config import SchedulerConfig
from model_shards.scheduler.sequence import SeqStatus, Sequence
from model_shards.scheduler.stats import SchedulerCounters
from model_shards.scheduler.step_builder import StepBuilder


class SchedulerState:
    """Rank 0's record of every live sequence and of the paged KV pool.

    ``waiting``: sequences not on the ranks (new, or preempted), served first
    come first served. ``running``: on the ranks and holding blocks, in
    admission order (oldest first). ``by_request``: every live sequence by
    request id. ``in_flight``: ids of sequences in a scheduled step that is not
    updated yet; they are neither scheduled nor preempted. ``to_free``: ids of
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
        self.to_free: list[int] = []
        self.counters = SchedulerCounters()

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

    def extend_and_add(self, seq: Sequence, end: int, step: StepBuilder) -> None:
        """Grow a running sequence's block table to cover ``end`` tokens; add its chunk."""
        self.counters.prefill_tokens += max(0, min(end, seq.prefill_end) - seq.num_computed)
        new_blocks = self.blocks.allocate(self.blocks.blocks_for(end) - len(seq.block_table))
        seq.block_table.extend(new_blocks)
        step.add(seq, seq.num_computed, end, new_blocks)

    def register_computed_blocks(self, seq: Sequence) -> None:
        """Offer the sequence's newly computed full blocks to the prefix cache."""
        if not self.config.enable_prefix_caching:
            return
        bs = self.config.block_size
        full = seq.num_computed // bs
        hashes = seq.block_hashes(full, bs)
        for i in range(seq.num_registered_blocks, full):
            self.blocks.register(seq.block_table[i], hashes[i])
        seq.num_registered_blocks = max(seq.num_registered_blocks, full)

    def retire(self, seq: Sequence) -> None:
        """A running sequence is done (finished or aborted): release and forget it."""
        self.running.remove(seq)
        self.release_blocks(seq)
        del self.by_request[seq.request_id]
        self.to_free.append(seq.seq_id)
        seq.status = SeqStatus.FINISHED

    def release_blocks(self, seq: Sequence) -> None:
        """Give back every block of ``seq``'s table (cached ones stay parked)."""
        # Tail first, so a sequence's deepest cached blocks are evicted before its
        # shared-prefix blocks (an evicted parent would make its children unreachable).
        self.blocks.release(reversed(seq.block_table))
        seq.block_table = []
