"""Decodes and preemption: one more token for a running sequence, blocks freed by recompute.

When a running sequence needs a block and none is free (after evicting parked
cached blocks), the newest running sequence not already in this step and in
no unfinished step (under the ``priority`` policy: the one ranking last) is *preempted*:
its blocks are released, its id goes out in this step's ``freed_seq_ids``, and it returns
to the waiting queue (:meth:`SchedulerState.enqueue`: the front, or its rank) with its
output so far, to be recomputed over prompt + output.
"""

from __future__ import annotations

from model_shards.config.scheduler import SchedulerConfig
from model_shards.engine.scheduler.sequence import SeqStatus, Sequence
from model_shards.engine.scheduler.state import SchedulerState, priority_rank
from model_shards.engine.scheduler.step_builder import StepBuilder
from model_shards.engine.speculative.proposer import BatchProposer, SeqProposer


def schedule_decode(
    state: SchedulerState, seq: Sequence, step: StepBuilder, speculate: bool = False
) -> None:
    """Add ``seq``'s next token to ``step`` (with ``speculate``, and the proposer's drafts after
    it if the free blocks hold them: drafts never preempt), preempting others if it needs a
    block."""
    end = seq.num_computed + 1
    state.release_outside_windows(seq)
    drafts = _drafts(state, seq, step) if speculate else []
    if drafts and state.blocks_to_extend(seq, end + len(drafts)) > state.blocks.num_free:
        drafts = []
    need = state.blocks_to_extend(seq, end + len(drafts))
    if make_room(state, seq, need, step):
        state.extend_and_add(seq, end + len(drafts), step, drafts)


def _drafts(state: SchedulerState, seq: Sequence, step: StepBuilder) -> list[int]:
    """Proposals after ``seq``'s last token: none under a grammar (its mask covers one
    position), at most what ``max_tokens``, the model length and the step's budget leave (a
    token kept for each other running sequence still to schedule)."""
    config = state.config
    if config.speculative is None or seq.request.grammar is not None:
        return []
    if seq.proposer is None:
        seq.proposer = SeqProposer.for_config(config.speculative)
    others = sum(1 for s in state.running if s is not seq and state.ready(s, step))
    room = min(step.budget - 1 - others, _room_left(config, seq))
    return seq.proposer.propose(seq.token_ids, room)


def _room_left(config: SchedulerConfig, seq: Sequence) -> int:
    """Drafts ``max_tokens`` and the model length leave room for after ``seq``'s next token."""
    return min(
        seq.request.max_tokens - len(seq.output_ids) - 1,
        config.max_model_len - len(seq.token_ids) - 1,
    )


def offer_drafts(state: SchedulerState, draft: BatchProposer, step: StepBuilder) -> None:
    """Before a speculating step: ``draft``'s proposals (in one batch) for each running decoding
    sequence ready for ``step`` that may take some (no grammar, its gate open), at most what
    ``max_tokens`` and the model length leave; :func:`_drafts` trims them to the step's budget."""
    spec = state.config.speculative
    assert spec is not None
    wants: dict[int, tuple[list[int], int]] = {}
    by_id: dict[int, SeqProposer] = {}
    for seq in state.running:
        if not state.ready(seq, step) or seq.is_prefilling or seq.request.grammar is not None:
            continue
        if seq.proposer is None:
            seq.proposer = SeqProposer.for_config(spec)
        k = min(spec.num_speculative_tokens, _room_left(state.config, seq))
        if k > 0 and not seq.proposer.paused:
            wants[seq.seq_id] = (seq.token_ids, k)
            by_id[seq.seq_id] = seq.proposer
    for seq_id, drafts in draft.propose(wants).items():
        by_id[seq_id].offer(len(wants[seq_id][0]), drafts)


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
    seq.table_cut = -1
    seq.num_computed = 0
    seq.num_registered_blocks = 0
    seq.status = SeqStatus.WAITING
    state.enqueue(seq, preempted=True)
    step.freed.append(seq.seq_id)
    step.preempted = True
    state.counters.preemptions += 1
