"""What global rank 0 learns from one step, and its way there from the sampling rank.

The sampler (the last stage's TP rank 0) has the sampled tokens (with their logprobs, when
asked) and the prompt scores of the plan's scoring chunks. When it is not global rank 0 it
sends them in a fixed order (:func:`send_step_result`); rank 0 knows from the plan which
parts come and how many rows each has (:func:`recv_step_result`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from model_shards.backends.base import Backend
from model_shards.messages import PromptLogprobs, SeqChunk, StepPlan, TokenLogprob
from model_shards.parallel.comm import Comm, Pending, recv_cpu, send_cpu
from model_shards.worker.prompt_logprobs import PromptScores, scoring_shape
from model_shards.worker.sampler import SampleOutput


@dataclass
class StepResult:
    """What global rank 0 learns from one step."""

    tokens: list[int]  # one per chunk with ``sample``
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[PromptLogprobs] = field(default_factory=list)  # per scoring chunk

    def get(self) -> StepResult:
        """Itself: already on the host (see :meth:`PendingResult.get`)."""
        return self


class PendingResult:
    """Global rank 0's result of a step it sampled itself, on its way to the host: the
    sampler's tensors are copied without waiting for the device (:meth:`Backend.to_host`), so
    the next step can be queued first; :meth:`get` waits for those copies alone."""

    def __init__(
        self,
        out: SampleOutput | None,
        scores: PromptScores | None,
        chunks: list[SeqChunk],
        ops: Backend,
    ) -> None:
        self._out = None if out is None else _sample_to_host(out, ops)
        self._scores = None if scores is None else _scores_to_host(scores, ops)
        self._chunks = chunks
        self._wait = ops.host_fence()

    def get(self) -> StepResult:
        self._wait()
        return step_result(self._out, self._scores, self._chunks)


def _sample_to_host(out: SampleOutput, ops: Backend) -> SampleOutput:
    """``out``'s tensors copied by ``ops.to_host``."""
    rest = (out.logprobs, out.top_ids, out.top_logprobs)
    return SampleOutput(
        ops.to_host(out.tokens), *(None if x is None else ops.to_host(x) for x in rest)
    )


def _scores_to_host(scores: PromptScores, ops: Backend) -> PromptScores:
    """``scores``' tensors copied by ``ops.to_host``."""
    parts = (scores.logprobs, scores.ranks, scores.top_ids, scores.top_logprobs)
    return PromptScores(*(ops.to_host(x) for x in parts))


def step_result(
    out: SampleOutput | None, scores: PromptScores | None, chunks: list[SeqChunk]
) -> StepResult:
    """The sampler's tensors of a step over ``chunks`` as a :class:`StepResult`."""
    result = StepResult([])
    if out is not None:
        result.tokens = out.tokens.tolist()
        if out.logprobs is not None and out.top_ids is not None and out.top_logprobs is not None:
            columns = (out.logprobs.tolist(), out.top_ids.tolist(), out.top_logprobs.tolist())
            result.logprobs = [TokenLogprob(*row) for row in zip(*columns, strict=True)]
    if scores is not None:
        result.prompt_logprobs = _per_chunk(scores, chunks)
    return result


def _per_chunk(scores: PromptScores, chunks: list[SeqChunk]) -> list[PromptLogprobs]:
    """The step's rows cut into one :class:`PromptLogprobs` per scoring chunk, each with its
    own ``top_k`` alternatives."""
    logprobs, ranks = scores.logprobs.tolist(), scores.ranks.tolist()
    top_ids, top_logprobs = scores.top_ids.tolist(), scores.top_logprobs.tolist()
    out = []
    lo = 0
    for chunk in chunks:
        if chunk.score is None:
            continue
        hi, k = lo + len(chunk.score.target_ids), chunk.score.top_k
        out.append(
            PromptLogprobs(
                logprobs[lo:hi],
                ranks[lo:hi],
                [row[:k] for row in top_ids[lo:hi]],
                [row[:k] for row in top_logprobs[lo:hi]],
            )
        )
        lo = hi
    return out


def send_step_result(
    out: SampleOutput | None, scores: PromptScores | None, comm: Comm, pending: Pending
) -> None:
    """The sampler, to global rank 0. Wire order: when the step sampled, header ``[S, K]``,
    tokens, then (``K >= 0``) logprobs, top ids and top logprobs (``K = -1``: no sequence asked
    for logprobs); then, when chunks scored, the ``R`` rows' logprobs, ranks and (``K > 0``)
    top ids and top logprobs."""
    if out is not None:
        k = -1 if out.top_ids is None else int(out.top_ids.shape[1])  # -1: no logprobs
        send_cpu(torch.tensor([out.tokens.shape[0], k], dtype=torch.int64), 0, comm, pending)
        send_cpu(out.tokens, 0, comm, pending)
        if k >= 0:
            assert out.logprobs is not None and out.top_logprobs is not None
            assert out.top_ids is not None
            send_cpu(out.logprobs, 0, comm, pending)
            if k > 0:  # gloo cannot send empty tensors
                send_cpu(out.top_ids, 0, comm, pending)
                send_cpu(out.top_logprobs, 0, comm, pending)
    if scores is not None:
        send_cpu(scores.logprobs, 0, comm, pending)
        send_cpu(scores.ranks, 0, comm, pending)
        if scores.top_ids.shape[1] > 0:
            send_cpu(scores.top_ids, 0, comm, pending)
            send_cpu(scores.top_logprobs, 0, comm, pending)


def recv_step_result(plan: StepPlan, comm: Comm, src: int) -> StepResult:
    """Global rank 0: the sampler's :func:`send_step_result` of ``plan``, from global rank
    ``src`` (nothing is received for a step that neither samples nor scores)."""
    out = None
    if any(c.sample for c in plan.chunks):
        s, k = recv_cpu((2,), torch.int64, src, comm).tolist()
        out = SampleOutput(recv_cpu((s,), torch.int64, src, comm))
        if k >= 0:
            out.logprobs = recv_cpu((s,), torch.float32, src, comm)
            out.top_ids = torch.empty(s, 0, dtype=torch.int64)
            out.top_logprobs = torch.empty(s, 0)
            if k > 0:
                out.top_ids = recv_cpu((s, k), torch.int64, src, comm)
                out.top_logprobs = recv_cpu((s, k), torch.float32, src, comm)
    scores = None
    shape = scoring_shape(plan.chunks)
    if shape is not None:
        r, k = shape
        scores = PromptScores(
            recv_cpu((r,), torch.float32, src, comm),
            recv_cpu((r,), torch.int64, src, comm),
            torch.empty(r, 0, dtype=torch.int64),
            torch.empty(r, 0),
        )
        if k > 0:
            scores.top_ids = recv_cpu((r, k), torch.int64, src, comm)
            scores.top_logprobs = recv_cpu((r, k), torch.float32, src, comm)
    return step_result(out, scores, plan.chunks)
