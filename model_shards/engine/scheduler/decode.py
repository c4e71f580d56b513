"""Decodes and preemption: one more token for a running sequence, blocks freed by recompute.

When a running sequence needs a block and none is free (after evicting parked
cached blocks), the newest running sequence not already in this step and in
no unfinished step (under the ``priority`` policy: the one ranking last) is *preempted*:
its blocks are released, its id goes out in this step's ``freed_seq_ids``, and it returns
to the waiting queue (:meth:`SchedulerState.enqueue`: the front, or its rank) with its
output so far, to be recomputed over prompt + output.
"""

from __future__ import annotations

from model_shards.engine.scheduler.sequence import SeqStatus, Sequence
from model_shards.engine.scheduler.state import SchedulerState, priority_rank
from model_shards.engine.scheduler.step_builder import StepBuilder


def schedule_decode(state: SchedulerState, seq: Sequence, step: StepBuilder) -> None:
    """Add ``seq``'s next token to ``step``, preempting others if it needs a block."""
    end = seq.num_computed + 1
    state.release_outside_windows(seq)
    need = state.blocks_to_extend(seq, end)
    if make_room(state, seq, need, step):
        state.extend_and_add(seq, end, step)


def make_room(state: SchedulerState, seq: Sequence, need: int, step: StepBuilder) -> bool:
    """Preempt unscheduled sequences (:meth:`SchedulerState.victims`) until ``need`` blocks
    are free.

    ``False`` if ``seq`` itself had to go, or if every other candidate is in flight.
    """
    while state.blocks.num_free < need:
        victim = next(state.victims(step), None)
        if victim is None:  # everyone else is in flight: wait for them
            return False
        _preempt(state, victim, step)
        if victim is seq:
            return False
    return True


def preempt_for_priority(state: SchedulerState, step: StepBuilder) -> None:
    """Under the ``priority`` policy, before a step: if the first waiting sequence has no seat
    or not the blocks of its first chunk, preempt the running sequence that ranks last, if it
    ranks after it (one a step; the waiting one is admitted in a later step)."""
    if state.config.scheduling_policy != "priority" or not state.waiting:
        return
    head, config = state.waiting[0], state.config
    first_chunk = min(len(head.token_ids), step.budget)
    blocks = config.num_kv_groups * state.blocks.blocks_for(first_chunk)
    if len(state.running) < config.max_num_seqs and blocks <= state.blocks.num_free:
        return
    victim = next(state.victims(step), None)
    if victim is not None and priority_rank(victim) > priority_rank(head):
        _preempt(state, victim, step)


def _preempt(state: SchedulerState, seq: Sequence, step: StepBuilder) -> None:
    state.running.remove(seq)
    state.release_blocks(seq)
    seq.num_computed = 0
    seq.num_registered_blocks = 0
    seq.status = SeqStatus.WAITING
    state.enqueue(seq, preempted=True)
    step.freed.append(seq.seq_id)
    step.preempted = True
    state.counters.preemptions += 1
