"""Rank 0's side of prompt logprobs (``GenerateRequest.prompt_logprobs``).

A prompt of ``P`` tokens has ``P - 1`` scores: the logits at position ``p`` score prompt token
``p + 1``. :meth:`PromptLogprobTracker.plan` marks, on each prefill chunk of a scoring request,
the rows not scored yet (:class:`~model_shards.messages.PromptScoring`), so that chunked
prefill spreads them over several steps and a re-prefill after a preemption scores nothing
twice; :meth:`record` keeps a step's scores, and :meth:`attach` puts the whole prompt's into
the request's first output (its first token comes from the step that scored the last row).
Such requests take no prefix-cache hit (:mod:`~model_shards.engine.scheduler.admission`), so
every row is computed. Pure Python.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from model_shards.engine.scheduler.sequence import Sequence, SeqUpdate
from model_shards.messages import PromptLogprobs, PromptScoring, SeqChunk


@dataclass
class _Scored:
    rows: int = 0  # rows 0 .. rows - 1 are scored
    parts: list[PromptLogprobs] = field(default_factory=list)
    sent: bool = False


class PromptLogprobTracker:
    """The scoring state of every live request that asked for prompt logprobs."""

    def __init__(self) -> None:
        self._seqs: dict[int, _Scored] = {}

    def plan(self, chunks: list[SeqChunk], sequences: list[Sequence]) -> list[SeqChunk]:
        """``chunks`` (of ``sequences``, in order), each with the rows it must score."""
        return [self._with_scoring(c, s) for c, s in zip(chunks, sequences, strict=True)]

    def _with_scoring(self, chunk: SeqChunk, seq: Sequence) -> SeqChunk:
        k = seq.request.prompt_logprobs
        if k is None:
            return chunk
        scored = self._seqs.setdefault(seq.seq_id, _Scored())
        first = max(chunk.start_pos, scored.rows)
        end = min(chunk.start_pos + len(chunk.token_ids), seq.num_prompt_tokens - 1)
        if first >= end:
            return chunk
        if scored.rows < chunk.start_pos:  # the scheduler gives these requests no cache hit
            raise RuntimeError(
                f"sequence {seq.seq_id}: prompt rows {scored.rows}..{chunk.start_pos - 1} "
                "were skipped, never scored"
            )
        scoring = PromptScoring(k, first - chunk.start_pos, seq.token_ids[first + 1 : end + 1])
        return msgspec.structs.replace(chunk, score=scoring)

    def record(
        self, chunks: list[SeqChunk], sequences: list[Sequence], scores: list[PromptLogprobs]
    ) -> None:
        """A finished step's ``scores``, one per scoring chunk of ``chunks`` (in order)."""
        parts = iter(scores)
        for chunk, seq in zip(chunks, sequences, strict=True):
            if chunk.score is None:
                continue
            part = next(parts)
            scored = self._seqs.get(seq.seq_id)
            if scored is not None:  # else aborted meanwhile
                scored.parts.append(part)
                scored.rows = chunk.start_pos + chunk.score.first_row + len(part.logprobs)

    def attach(self, updates: list[SeqUpdate]) -> list[SeqUpdate]:
        """``updates`` with each fully scored prompt's logprobs in its request's first output;
        a finished request's state is dropped."""
        out = []
        for update in updates:
            seq = update.sequence
            scored = self._seqs.get(seq.seq_id)
            if scored is None:
                out.append(update)
                continue
            if not scored.sent and scored.rows >= seq.num_prompt_tokens - 1:
                output = msgspec.structs.replace(update.output, prompt_logprobs=_join(scored.parts))
                update = SeqUpdate(seq, output)
                scored.sent, scored.parts = True, []
            if update.output.finish_reason is not None:
                self.drop(seq.seq_id)
            out.append(update)
        return out

    def drop(self, seq_id: int) -> None:
        """Forget a finished or aborted sequence."""
        self._seqs.pop(seq_id, None)


def _join(parts: list[PromptLogprobs]) -> PromptLogprobs:
    return PromptLogprobs(
        [x for p in parts for x in p.logprobs],
        [x for p in parts for x in p.ranks],
        [x for p in parts for x in p.top_ids],
        [x for p in parts for x in p.top_logprobs],
    )
