"""Async scheduling: a sequence's next chunk planned while its current one is in flight.

With ``SchedulerConfig.async_scheduling`` the coordinator schedules step N+1 before it knows
step N's tokens, so the device never waits on the host between steps. A sequence with a chunk
in step N (the latest step in flight) gets, in step N+1:

* after a prompt chunk short of the prompt's end: the next prompt chunk (its tokens are known);
* after a chunk that samples: a one-token decode chunk whose token is a *future token*
  ``-(1 + i)`` (:func:`future_token`): the ranks read the ``i``-th token step N sampled, on the
  device, where it already is (:mod:`model_shards.worker.future_tokens`).

Its positions, blocks and KV writes follow on from step N's chunk; :meth:`Scheduler.update`
applies step N's tokens first, then step N+1's, each through the usual stop checks. A sequence
that step N's token finishes (a stop token, a client's abort) is retired then: its step N+1
row still runs, and that token is dropped, never sent; the blocks it was written into went back
with the rest of its blocks, and no later step can write them before step N+1 has run.

Not run ahead (the sequence waits for its tokens, as without async scheduling): a sequence
under a grammar (its next mask needs the token), one whose sampler reads its history
(:attr:`~model_shards.messages.SamplingParams.needs_history`), one scoring its prompt, one that
step N's token ends by length, speculative decoding's verify chunks, a model with several KV
groups; and any chunk whose blocks are not free (running ahead never preempts).
"""

from __future__ import annotations

from model_shards.config.scheduler import SchedulerConfig
from model_shards.engine.scheduler.prefill import prompt_chunk_len
from model_shards.engine.scheduler.sequence import Ahead, ScheduledStep, SeqStatus, Sequence
from model_shards.engine.scheduler.state import SchedulerState
from model_shards.engine.scheduler.step_builder import StepBuilder
from model_shards.messages import SeqChunk


def future_token(row: int) -> int:
    """The token id standing for the ``row``-th token the previous step sampled."""
    return -1 - row


def may_run_ahead(config: SchedulerConfig, seq: Sequence, chunk: SeqChunk) -> bool:
    """Whether ``seq``'s next chunk may be scheduled while ``chunk`` is in flight."""
    request = seq.request
    if (
        config.num_kv_groups > 1
        or chunk.num_draft
        or request.grammar is not None
        or request.prompt_logprobs is not None
        or seq.sampling.needs_history
    ):
        return False
    if not chunk.sample:
        return True
    # does the token ``chunk`` samples (at position ``length - 1``) end the sequence by length?
    length = chunk.start_pos + len(chunk.token_ids) + 1
    return length - seq.num_prompt_tokens < request.max_tokens and length < config.max_model_len


def note_ahead(state: SchedulerState, step: ScheduledStep) -> None:
    """After scheduling ``step``: record which of its sequences the next step may run ahead."""
    row = 0
    for seq, chunk in zip(step.sequences, step.chunks, strict=True):
        if may_run_ahead(state.config, seq, chunk):
            state.ahead[seq.seq_id] = Ahead(chunk, row if chunk.sample else -1)
        if chunk.sample:
            row += 1 + chunk.num_draft


def runs_ahead(state: SchedulerState, seq: Sequence, step: StepBuilder) -> Ahead | None:
    """``seq``'s chunk in flight if ``step`` may take its next one now, else ``None``."""
    if seq.status is not SeqStatus.RUNNING or seq.seq_id in step.scheduled:
        return None
    return state.ahead.get(seq.seq_id)


def schedule_ahead(state: SchedulerState, seq: Sequence, ahead: Ahead, step: StepBuilder) -> None:
    """Add the chunk that follows ``ahead``'s to ``step``, if the free blocks hold it."""
    start = ahead.end
    if ahead.row >= 0:  # a decode of the token in flight
        if state.blocks_to_extend(seq, start + 1) > state.blocks.num_free:
            return
        new_blocks, _ = state.extend(seq, start, start + 1)
        step.add_chunk(
            seq, SeqChunk(seq.seq_id, start, [future_token(ahead.row)], True, new_blocks)
        )
        return
    n = prompt_chunk_len(state, seq, start, step.budget)  # the prompt's next chunk
    if n > 0:
        step.add(seq, start, start + n, *state.extend(seq, start, start + n))


def done_with(state: SchedulerState, chunk: SeqChunk) -> None:
    """``chunk``'s step was applied: its sequence leaves the steps in flight unless a later
    step holds its next chunk."""
    ahead = state.ahead.get(chunk.seq_id)
    if ahead is None or ahead.chunk is chunk:
        state.in_flight.discard(chunk.seq_id)
        state.ahead.pop(chunk.seq_id, None)
