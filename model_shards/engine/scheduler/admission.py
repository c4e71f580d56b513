"""Admission: start the first waiting sequence after its prefix-cache hit, if it fits.

First come first served: a waiting sequence that cannot start (no seat, budget, blocks, or
a LoRA adapter slot: :mod:`.lora_slots`) blocks the ones behind it. A sequence whose next
full prompt block a running sequence is computing right now (``n > 1`` choices of one
prompt, identical prompts) waits until that block is cached, then shares it. A request that
scores its prompt (``prompt_logprobs``) takes no hit: a cached block has no logits (vLLM does
the same).
"""

from __future__ import annotations

from model_shards.engine.scheduler.group_hits import cached_tables
from model_shards.engine.scheduler.sequence import SeqStatus, Sequence
from model_shards.engine.scheduler.state import SchedulerState
from model_shards.engine.scheduler.step_builder import StepBuilder
from model_shards.messages import LoraLoad, NewSequence


def admit(state: SchedulerState, step: StepBuilder) -> bool:
    """Start the first waiting sequence if a seat, budget and blocks allow it."""
    config = state.config
    if not state.waiting or step.full or len(state.running) >= config.max_num_seqs:
        return False
    seq = state.waiting[0]
    bs, groups = config.block_size, config.num_kv_groups
    hit_tables: list[list[int]] = [[] for _ in range(groups)]
    if config.enable_prefix_caching and seq.request.prompt_logprobs is None:
        max_hits = (len(seq.token_ids) - 1) // bs
        hashes = seq.block_hashes(max_hits, bs)
        hit_tables = cached_tables(state.blocks, hashes, config.kv_windows, bs)
        if len(hit_tables[0]) < max_hits and _being_computed(state, seq, len(hit_tables[0])):
            return False  # wait a step and share those blocks instead of recomputing
    num_hits = len(hit_tables[0])
    hits = [b for table in hit_tables for b in table if b >= 0]
    start = num_hits * bs
    end = start + min(len(seq.token_ids) - start, step.budget)
    need = state.blocks.blocks_for(end) - num_hits
    if groups * need > state.blocks.num_free - state.blocks.num_parked_among(hits):
        return False
    if seq.request.lora is not None:
        found = state.lora_slots.acquire(seq.request.lora)
        if found is None:
            return False  # every slot's adapter is in use: wait for one to be released
        seq.lora_slot, load = found
        if load:
            step.lora_loads.append(LoraLoad(seq.lora_slot, seq.request.lora))
    state.waiting.popleft()
    state.blocks.acquire(hits)
    seq.block_table = hit_tables[0] + state.blocks.allocate(need)
    seq.window_tables = [t + state.blocks.allocate(need) for t in hit_tables[1:]]
    seq.num_computed = start
    seq.prefill_end = len(seq.token_ids)
    seq.num_registered_blocks = num_hits
    seq.status = SeqStatus.RUNNING
    state.running.append(seq)
    state.counters.hit_tokens += start
    state.counters.prefill_tokens += end - start
    step.new_sequences.append(
        NewSequence(seq.seq_id, seq.sampling, seq.num_prompt_tokens, media=seq.request.media)
    )
    # the ranks' tables take 0 where a hit left an entry outside the window (never read)
    tables = [[max(b, 0) for b in t] for t in (seq.block_table, *seq.window_tables)]
    step.add(seq, start, end, tables[0], tables[1:])
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
