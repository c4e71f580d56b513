"""Rank 0's side of constrained decoding: waiting for grammars, matchers, masks computed ahead.

Life of a constrained request (its :attr:`GenerateRequest.grammar` set):

1. :meth:`Constraints.submit` starts (or joins) its grammar's compile and holds the
   request; the scheduler has not seen it, so a slow compile delays nobody else;
2. once compiled, a mask thread (:mod:`.mask_pool`) makes its matcher, feeds it the tokens
   the request already produced (``resume_output_ids``: the replay after a rank restart
   continues exactly where the failed run was) and fills its first mask;
3. :meth:`Constraints.ready` hands back the requests whose first mask is ready (the
   coordinator queues them and :meth:`Constraints.attach` their matcher) or that failed
   (a compile error or deadline, a resumed token the grammar refuses: refused);
4. each step, :meth:`Constraints.masks` hands over the ready mask of every constrained
   sequence the step samples; they travel in the plan to the sampling rank (any rank);
5. :meth:`Constraints.advance` gives each sampled token to a mask thread, which feeds it to
   the matcher and fills the next mask while the step loop goes on: the sequence is
   *held* (the coordinator keeps it out of steps) until :meth:`Constraints.settle` finds
   its mask done. ``settle`` waits for a mask at most ``grace_s`` after it was asked for,
   so a slow grammar delays the others' next step once, by that much at most; a mask
   still not done ``deadline_s`` after its thread started it ends its request.

A matcher is only touched by one job at a time, and never by the step loop. A preempted
sequence keeps its matcher and mask (its output is kept and recomputed, not redrawn). A
matcher that has terminated (its grammar is complete and a stop token accepted) no longer
masks.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from dataclasses import dataclass
from typing import Any

from model_shards.engine.scheduler.sequence import SeqStatus, Sequence
from model_shards.engine.structured.compile_pool import GrammarError
from model_shards.engine.structured.grammars import GrammarCache
from model_shards.engine.structured.mask_pool import MaskJob, MaskPool
from model_shards.messages import GenerateRequest, TokenMask

log = logging.getLogger(__name__)

#: How long a step waits for a mask asked for just before it, and how long one mask may take.
MASK_GRACE_S = 0.005
MASK_DEADLINE_S = 1.0


@dataclass
class _Lane:
    """One constrained sequence's matcher and its next token's mask (``None``: none needed)."""

    matcher: Any
    mask: bytes | None = None
    job: MaskJob | None = None  # filling ``mask``: the sequence is held meanwhile
    request_id: str = ""


@dataclass
class _Waiting:
    request: GenerateRequest
    client: bytes
    compile: concurrent.futures.Future[Any]
    start: MaskJob | None = None  # the new matcher and its first mask, once compiled


@dataclass
class Ready:
    """A request whose grammar is known: its ``lane`` (matcher and first mask), or ``error``."""

    request: GenerateRequest
    client: bytes
    lane: _Lane | None = None
    error: GrammarError | None = None


class Constraints:
    """Every constrained request of one replica's rank 0 (see the module docstring)."""

    def __init__(
        self,
        cache: GrammarCache,
        vocab_size: int,
        *,
        grace_s: float = MASK_GRACE_S,
        deadline_s: float = MASK_DEADLINE_S,
    ) -> None:
        self.cache = cache
        self.vocab_size = vocab_size
        self.grace_s = grace_s
        self.deadline_s = deadline_s
        self.pool = MaskPool()
        self._waiting: dict[str, _Waiting] = {}
        self._lanes: dict[int, _Lane] = {}  # seq id → lane
        self._orphans: list[MaskJob] = []  # jobs of dropped lanes, still running

    @staticmethod
    def for_model(
        model_dir: str | None, vocab_size: int, eos_token_ids: tuple[int, ...], timeout_s: float
    ) -> Constraints | None:
        """Structured output's grammars, or ``None`` (refused) without a ``model_dir``."""
        if model_dir is None:
            return None
        eos = list(eos_token_ids)
        return Constraints(
            GrammarCache(model_dir, vocab_size, eos, compile_timeout_s=timeout_s), vocab_size
        )

    def submit(self, request: GenerateRequest, client: bytes) -> None:
        """Hold ``request`` until its grammar is compiled; ``ValueError`` if its id is held."""
        assert request.grammar is not None
        if request.request_id in self._waiting:
            raise ValueError(f"request id {request.request_id!r} is already running")
        compiling = self.cache.get(request.grammar)
        self._waiting[request.request_id] = _Waiting(request, client, compiling)

    def abort(self, request_id: str) -> tuple[GenerateRequest, bytes] | None:
        """Forget a request not queued yet: (it, its client), or ``None``."""
        waiting = self._waiting.pop(request_id, None)
        if waiting is None:
            return None
        if waiting.start is not None:
            self._orphans.append(waiting.start)
        return waiting.request, waiting.client

    def client_of(self, request_id: str) -> bytes | None:
        """The client of a request still waiting for its grammar, or ``None``."""
        waiting = self._waiting.get(request_id)
        return None if waiting is None else waiting.client

    def has_waiting(self) -> bool:
        """Requests not queued yet, or sequences held for their mask."""
        return bool(self._waiting) or any(lane.job is not None for lane in self._lanes.values())

    def wait(self, timeout_s: float) -> None:
        """Block up to ``timeout_s`` for one compile or mask to finish."""
        futures = [w.compile if w.start is None else w.start.future for w in self._waiting.values()]
        futures += [lane.job.future for lane in self._lanes.values() if lane.job is not None]
        concurrent.futures.wait(futures, timeout_s, concurrent.futures.FIRST_COMPLETED)

    def ready(self) -> list[Ready]:
        """Requests whose first mask is ready, or that failed, removed from the waiting set."""
        out = []
        now = time.monotonic()
        for rid, w in list(self._waiting.items()):
            if w.start is None and w.compile.done():
                exc = w.compile.exception()
                if exc is None:
                    w.start = self._start(w.request, w.compile.result())
                else:
                    error = exc if isinstance(exc, GrammarError) else GrammarError(str(exc))
                    out.append(Ready(w.request, w.client, error=error))
                    del self._waiting[rid]
                    continue
            if w.start is None:
                continue
            if w.start.future.done():
                del self._waiting[rid]
                exc = w.start.future.exception()
                if exc is None:
                    out.append(Ready(w.request, w.client, lane=w.start.future.result()))
                else:
                    out.append(Ready(w.request, w.client, error=GrammarError(str(exc))))
            elif w.start.overdue(now):
                del self._waiting[rid]
                self.pool.replace(w.start)
                out.append(Ready(w.request, w.client, error=self._too_slow(rid)))
        return out

    def _start(self, request: GenerateRequest, compiled: Any) -> MaskJob:
        resumed = list(request.resume_output_ids)

        def start() -> _Lane:
            import xgrammar

            matcher = xgrammar.GrammarMatcher(compiled)
            for i, token in enumerate(resumed):
                if not matcher.accept_token(token):
                    raise ValueError(
                        f"request {request.request_id!r}: resumed token {i} ({token}) breaks "
                        "its grammar"
                    )
            return _Lane(matcher, self._fill(matcher))

        return self.pool.submit(start, self.deadline_s * (1 + len(resumed)))

    def _too_slow(self, request_id: str) -> GrammarError:
        return GrammarError(
            f"request {request_id!r}: its grammar could not keep up (a token mask took longer "
            f"than {self.deadline_s:g} s); simplify the grammar",
            "grammar_too_slow",
        )

    def attach(self, seq: Sequence, lane: _Lane) -> None:
        """``seq`` (queued from a :class:`Ready`) decodes with ``lane``'s matcher."""
        lane.request_id = seq.request_id
        self._lanes[seq.seq_id] = lane

    def masks(self, sequences: list[Sequence]) -> list[TokenMask]:
        """The masks of the constrained ones of a step's sampled ``sequences`` (never held)."""
        out = []
        for seq in sequences:
            lane = self._lanes.get(seq.seq_id)
            if lane is None:
                continue
            if lane.job is not None:
                raise RuntimeError(f"sequence {seq.seq_id} was scheduled before its mask was ready")
            if lane.mask is not None:
                out.append(TokenMask(seq.seq_id, lane.mask))
        return out

    def advance(self, sequences: list[Sequence], tokens: list[int]) -> list[int]:
        """Give each sampled token to its sequence's matcher, in a mask thread that then fills
        the next mask; the ids of the sequences now held. Finished sequences' lanes go."""
        held = []
        for seq, token in zip(sequences, tokens, strict=True):
            lane = self._lanes.get(seq.seq_id)
            if lane is None:
                continue
            if seq.status is SeqStatus.FINISHED:
                del self._lanes[seq.seq_id]
                continue
            lane.job = self.pool.submit(
                self._next(seq.seq_id, lane.matcher, token), self.deadline_s
            )
            held.append(seq.seq_id)
        return held

    def _next(self, seq_id: int, matcher: Any, token: int) -> Any:
        def run() -> bytes | None:
            if not matcher.is_terminated() and not matcher.accept_token(token):
                log.warning("sequence %d: sampled token %d outside its grammar", seq_id, token)
            return self._fill(matcher)

        return run

    def _fill(self, matcher: Any) -> bytes | None:
        """``matcher``'s next mask as wire bytes; ``None`` once it has terminated."""
        import xgrammar

        if matcher.is_terminated():
            return None
        bitmask = xgrammar.allocate_token_bitmask(1, self.vocab_size)
        matcher.fill_next_token_bitmask(bitmask, 0)
        return bitmask[0].numpy().tobytes()

    def settle(self) -> tuple[list[int], list[tuple[int, GrammarError]]]:
        """Wait (up to ``grace_s`` after each was asked for) for the held sequences' masks:
        the ids of the sequences whose mask is now ready, and of those past the deadline
        (with the error their request ends with; their lanes are gone)."""
        self._reap_orphans()
        pending = [lane.job for lane in self._lanes.values() if lane.job is not None]
        if not pending:
            return [], []
        now = time.monotonic()
        until = max(job.submitted_at for job in pending) + self.grace_s
        young = [job.future for job in pending if job.submitted_at + self.grace_s > now]
        if young:
            concurrent.futures.wait(young, until - now)
        released: list[int] = []
        overdue: list[tuple[int, GrammarError]] = []
        now = time.monotonic()
        for seq_id, lane in list(self._lanes.items()):
            job = lane.job
            if job is None:
                continue
            if job.future.done():
                lane.job = None
                exc = job.future.exception()
                if exc is None:
                    lane.mask = job.future.result()
                    released.append(seq_id)
                else:
                    del self._lanes[seq_id]
                    problem = f"request {lane.request_id!r}: its grammar failed: {exc}"
                    overdue.append((seq_id, GrammarError(problem)))
            elif job.overdue(now):
                del self._lanes[seq_id]
                self.pool.replace(job)
                overdue.append((seq_id, self._too_slow(lane.request_id)))
        return released, overdue

    def _reap_orphans(self) -> None:
        """Replace the threads of dropped lanes' jobs past their deadline; forget done ones."""
        now = time.monotonic()
        for job in self._orphans:
            if job.overdue(now):
                self.pool.replace(job)
        self._orphans = [j for j in self._orphans if not (j.future.done() or j.replaced)]

    def drop(self, seq_id: int) -> None:
        """Forget ``seq_id``'s lane (aborted); a mask being filled for it is left to finish."""
        lane = self._lanes.pop(seq_id, None)
        if lane is not None and lane.job is not None:
            self._orphans.append(lane.job)

    def close(self) -> None:
        self.pool.close()
        self.cache.close()
