"""Admission: start the first waiting sequence after its prefix-cache hit, if it fits.

First come first served: a waiting sequence that cannot start blocks the ones
behind it. A sequence whose next full prompt block a running sequence is
computing right now (``n > 1`` choices of one prompt, identical prompts)
waits until that block is cached, then shares it.
"""

from __future__ import annotations

from model_shards.messages import NewSequence
from model_shards.scheduler.sequence import SeqStatus, Sequence
from model_shards.scheduler.state import SchedulerState
from model_shards.scheduler.step_builder import StepBuilder


def admit(state: SchedulerState, step: StepBuilder) -> bool:
    """Start the first waiting sequence if a seat, budget and blocks allow it."""
    config = state.config
    if not state.waiting or step.full or len(state.running) >= config.max_num_seqs:
        return False
    seq = state.waiting[0]
    bs = config.block_size
    hits: list[int] = []
    if config.enable_prefix_caching:
        max_hits = (len(seq.token_ids) - 1) // bs
        hits = state.blocks.cached_prefix(seq.block_hashes(max_hits, bs))
        if len(hits) < max_hits and _being_computed(state, seq, len(hits)):
            return False  # wait a step and share those blocks instead of recomputing
    start = len(hits) * bs
    end = start + min(len(seq.token_ids) - start, step.budget)
    need = state.blocks.blocks_for(end) - len(hits)
    if need > state.blocks.num_free - state.blocks.num_parked_among(hits):
        return False
    state.waiting.popleft()
    state.blocks.acquire(hits)
    seq.block_table = hits + state.blocks.allocate(need)
    seq.num_computed = start
    seq.prefill_end = len(seq.token_ids)
    seq.num_registered_blocks = len(hits)
    seq.status = SeqStatus.RUNNING
    state.running.append(seq)
    state.counters.hit_tokens += start
    state.counters.prefill_tokens += end - start
    step.new_sequences.append(NewSequence(seq.seq_id, seq.sampling, seq.num_prompt_tokens))
    step.add(seq, start, end, list(seq.block_table))
    return True


def _being_computed(state: SchedulerState, seq: Sequence, index: int) -> bool:
    """Whether a running sequence is computing ``seq``'s full prompt block ``index``
    (same chained hash, so the same tokens up to there) and will cache it.

    The ``n`` choices of one prompt, and identical prompts arriving together,
    then compute the shared blocks once: the first runs, the others wait for
    the blocks to land in the prefix cache.
    """
    bs = state.config.block_size
    (*_, want) = seq.block_hashes(index + 1, bs)
    return any(
        s.num_computed < (index + 1) * bs <= s.prefill_end
        and s.num_registered_blocks <= index
        and s.block_hashes(index + 1, bs)[index] == want
        for s in state.running
    )
