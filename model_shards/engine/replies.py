"""What rank 0 sends its frontends after a step: outputs grouped per client, with counters.

A reply is ``(client identity, message)`` for :mod:`model_shards.engine.zmq_loop`; every
``StepOutputs`` carries the engine's counters (:class:`~model_shards.messages.EngineStats`)
as they stand after the step, which the frontend turns into ``/metrics``.
"""

from __future__ import annotations

from collections import defaultdict
from itertools import accumulate

import msgspec

from model_shards.engine.scheduler.scheduler import SchedulerStats, SeqUpdate
from model_shards.engine.scheduler.sequence import Sequence
from model_shards.engine.zmq_loop import Reply
from model_shards.messages import EngineStats, RequestOutput, SeqChunk, StepOutputs, TokenLogprob


def by_client(updates: list[SeqUpdate]) -> list[Reply]:
    """One ``StepOutputs`` per frontend, holding its requests' outputs in order."""
    grouped: dict[bytes, list[RequestOutput]] = defaultdict(list)
    for update in updates:
        grouped[update.sequence.client].append(update.output)
    return [(client, StepOutputs(outputs)) for client, outputs in grouped.items()]


def engine_stats(
    s: SchedulerStats, encoder_cache: tuple[int, int], expert_tokens: dict[int, list[int]] | None
) -> EngineStats:
    """The counters of one moment: the scheduler's, the media encoder cache's ``(hits,
    misses)`` and the MoE expert-token sample (``None``: a dense model, or not due yet)."""
    return EngineStats(
        num_running=s.num_running,
        num_waiting=s.num_waiting,
        kv_blocks_used=s.num_blocks - s.num_free_blocks,
        kv_blocks_total=s.num_blocks,
        prefix_cache_hit_tokens=s.prefix_cache_hit_tokens,
        prefill_tokens_computed=s.prefill_tokens_computed,
        num_preemptions=s.num_preemptions,
        mm_encoder_cache_hits=encoder_cache[0],
        mm_encoder_cache_misses=encoder_cache[1],
        moe_expert_tokens=expert_tokens,
        spec_num_drafts=s.spec.drafts,
        spec_num_draft_tokens=s.spec.draft_tokens,
        spec_num_accepted_tokens=s.spec.accepted_tokens,
        spec_accepted_per_pos=list(s.spec.accepted_per_pos),
    )


def with_stats(replies: list[Reply], stats: EngineStats) -> list[Reply]:
    """``replies`` with ``stats`` attached to every ``StepOutputs`` (other messages as they are)."""
    return [
        (client, msgspec.structs.replace(m, stats=stats) if isinstance(m, StepOutputs) else m)
        for client, m in replies
    ]


def first_rows(chunks: list[SeqChunk]) -> list[int]:
    """Where each sampled chunk's rows start among a step's sampled rows (``1 + num_draft``
    each), then their total."""
    return list(accumulate((1 + c.num_draft for c in chunks if c.sample), initial=0))


def with_logprobs(
    updates: list[SeqUpdate], sampled: list[Sequence], firsts: list[int], rows: list[TokenLogprob]
) -> list[SeqUpdate]:
    """``updates`` with the logprobs of their tokens, for the sequences that asked: a chunk
    emits its first rows' tokens, so each output takes its first ``len(new_token_ids)`` rows
    (``sampled``: the sequences of the sampled chunks; ``firsts``: :func:`first_rows`)."""
    by_seq = {id(s): rows[a:b] for s, a, b in zip(sampled, firsts, firsts[1:], strict=False)}
    return [
        SeqUpdate(
            u.sequence,
            msgspec.structs.replace(
                u.output, logprobs=by_seq[id(u.sequence)][: len(u.output.new_token_ids)]
            ),
        )
        if u.sequence.request.sampling.logprobs is not None
        else u
        for u in updates
    ]
