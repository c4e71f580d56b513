"""Prefill chunking: a step's token and seat limits (the pipeline cap), a prompt's next chunk."""

from __future__ import annotations

from model_shards.engine.scheduler.decode import make_room
from model_shards.engine.scheduler.sequence import Sequence
from model_shards.engine.scheduler.state import SchedulerState
from model_shards.engine.scheduler.step_builder import StepBuilder

# The smallest prompt-token cap of a pipeline micro-batch: smaller chunks start the
# later stages sooner but run the prompts slower.
PIPELINE_MIN_PREFILL = 256


def step_limits(state: SchedulerState, micro_batches: int) -> tuple[int, int]:
    """``(token budget, seats)`` of the next step.

    ``micro_batches > 1`` (pipeline overlap): the step takes at most its share,
    ``ceil(live / micro_batches)``, of the live sequences (running plus those
    that could be admitted), so that the others fill the next micro-batches
    instead of leaving the pipeline with one batch in flight. Its prompt tokens
    are also capped at ``ceil(backlog / (2 * micro_batches))`` (not below
    ``PIPELINE_MIN_PREFILL``), ``backlog`` being the prompt tokens not yet
    scheduled: the later stages idle while the first one runs the first step,
    and the pipeline drains unevenly behind the last expensive one, so a burst
    of prompts goes in as shrinking chunks rather than two large micro-batches.
    """
    config = state.config
    live = min(config.max_num_seqs, len(state.running) + len(state.waiting))
    seats = -(-live // micro_batches)  # with one micro-batch: every live sequence
    budget = config.max_num_batched_tokens
    if micro_batches > 1:
        prefill_cap = max(PIPELINE_MIN_PREFILL, -(-_backlog(state) // (2 * micro_batches)))
        budget = min(budget, seats + prefill_cap)  # a seat's decode costs one token
    return budget, seats


def _backlog(state: SchedulerState) -> int:
    """Prompt tokens not yet scheduled (waiting sequences, unfinished prefills)."""
    waiting = sum(len(seq.token_ids) for seq in state.waiting)
    return waiting + sum(
        len(seq.token_ids) - seq.num_computed
        for seq in state.running
        if seq.is_prefilling and seq.seq_id not in state.in_flight
    )


def schedule_prefill(state: SchedulerState, seq: Sequence, step: StepBuilder) -> None:
    """The next prompt chunk, shrunk to the blocks that can be had (preempting if none)."""
    bs, groups = state.config.block_size, state.config.num_kv_groups
    state.release_outside_windows(seq)
    table_full = len(seq.block_table) * bs == seq.num_computed
    if not make_room(state, seq, groups if table_full else 0, step):
        return
    n = prompt_chunk_len(state, seq, seq.num_computed, step.budget)
    state.extend_and_add(seq, seq.num_computed + n, step)


def prompt_chunk_len(state: SchedulerState, seq: Sequence, start: int, budget: int) -> int:
    """Prompt tokens from ``start`` the next chunk of ``seq`` can take: within ``budget`` and
    the blocks its tables hold or can have from the free ones."""
    bs, groups = state.config.block_size, state.config.num_kv_groups
    blocks_free = state.blocks.num_free // groups  # each block of positions takes one per group
    capacity = (len(seq.block_table) + blocks_free) * bs - start
    return min(len(seq.token_ids) - start, budget, capacity)
