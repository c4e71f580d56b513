"""Rank 0's side of constrained decoding: waiting for grammars, matchers, step masks.

Life of a constrained request (its :attr:`GenerateRequest.grammar` set):

1. :meth:`Constraints.submit` starts (or joins) its grammar's compile and holds the
   request; the scheduler has not seen it, so a slow compile delays nobody else;
2. :meth:`Constraints.ready` hands back the requests whose grammar is compiled (the
   coordinator queues them) or failed (the coordinator refuses them);
3. :meth:`Constraints.start` gives the queued sequence a matcher and feeds it the
   tokens the request already produced (``resume_output_ids``: the replay after a rank
   restart continues exactly where the failed run was);
4. each step, :meth:`Constraints.masks` fills the mask of every constrained sequence
   the step samples; they travel in the plan to the sampling rank (any rank: pp > 1);
5. :meth:`Constraints.advance` feeds each sampled token to its matcher.

The scheduler never schedules a sequence whose previous step is still in flight, so a
matcher has seen every earlier token when its mask is filled. A preempted sequence
keeps its matcher (its output is kept and recomputed, not redrawn). A matcher that
has terminated (its grammar is complete and a stop token accepted) no longer masks.
"""

from __future__ import annotations

import concurrent.futures
import logging
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from model_shards.engine.scheduler.sequence import SeqStatus, Sequence
from model_shards.engine.structured.grammars import GrammarCache
from model_shards.messages import GenerateRequest, TokenMask

log = logging.getLogger(__name__)


@dataclass
class _Waiting:
    request: GenerateRequest
    client: bytes
    future: Future[Any]


@dataclass
class Ready:
    """A request whose grammar is known: ``compiled`` or ``error`` (``ValueError`` text)."""

    request: GenerateRequest
    client: bytes
    compiled: Any = None
    error: str | None = None


class Constraints:
    """Every constrained request of one replica's rank 0 (see the module docstring)."""

    def __init__(self, cache: GrammarCache, vocab_size: int) -> None:
        self.cache = cache
        self.vocab_size = vocab_size
        self._waiting: dict[str, _Waiting] = {}
        self._matchers: dict[int, Any] = {}  # seq id → xgrammar.GrammarMatcher
        self._bitmask: Any = None  # a reused [rows, W] int32 tensor

    def submit(self, request: GenerateRequest, client: bytes) -> None:
        """Hold ``request`` until its grammar is compiled; ``ValueError`` if its id is held."""
        assert request.grammar is not None
        if request.request_id in self._waiting:
            raise ValueError(f"request id {request.request_id!r} is already running")
        self._waiting[request.request_id] = _Waiting(
            request, client, self.cache.get(request.grammar)
        )

    def abort(self, request_id: str) -> tuple[GenerateRequest, bytes] | None:
        """Forget a request still waiting for its grammar: (it, its client), or ``None``."""
        waiting = self._waiting.pop(request_id, None)
        return None if waiting is None else (waiting.request, waiting.client)

    def client_of(self, request_id: str) -> bytes | None:
        """The client of a request still waiting for its grammar, or ``None``."""
        waiting = self._waiting.get(request_id)
        return None if waiting is None else waiting.client

    def has_waiting(self) -> bool:
        return bool(self._waiting)

    def wait(self, timeout_s: float) -> None:
        """Block up to ``timeout_s`` for one waiting grammar to finish compiling."""
        futures = [w.future for w in self._waiting.values()]
        concurrent.futures.wait(futures, timeout_s, concurrent.futures.FIRST_COMPLETED)

    def ready(self) -> list[Ready]:
        """Requests whose grammar compiled (or failed), removed from the waiting set."""
        out = []
        for rid, w in list(self._waiting.items()):
            if not w.future.done():
                continue
            del self._waiting[rid]
            exc = w.future.exception()
            if exc is not None:
                out.append(Ready(w.request, w.client, error=str(exc)))
            else:
                out.append(Ready(w.request, w.client, compiled=w.future.result()))
        return out

    def start(self, seq: Sequence, compiled: Any) -> str | None:
        """Give ``seq`` its matcher, fed ``seq``'s output so far; the problem, or ``None``."""
        import xgrammar

        matcher = xgrammar.GrammarMatcher(compiled)
        for i, token in enumerate(seq.output_ids):
            if not matcher.accept_token(token):
                return f"request {seq.request_id!r}: resumed token {i} ({token}) breaks its grammar"
        self._matchers[seq.seq_id] = matcher
        return None

    def masks(self, sequences: list[Sequence]) -> list[TokenMask]:
        """The masks of the constrained ones of a step's sampled ``sequences``."""
        rows = [
            (s.seq_id, m)
            for s in sequences
            if (m := self._matchers.get(s.seq_id)) is not None and not m.is_terminated()
        ]
        if not rows:
            return []
        import xgrammar

        if self._bitmask is None or self._bitmask.shape[0] < len(rows):
            self._bitmask = xgrammar.allocate_token_bitmask(max(len(rows), 8), self.vocab_size)
        bitmask = self._bitmask
        for i, (_, matcher) in enumerate(rows):
            matcher.fill_next_token_bitmask(bitmask, i)
        data = bitmask[: len(rows)].numpy()
        return [TokenMask(seq_id, data[i].tobytes()) for i, (seq_id, _) in enumerate(rows)]

    def advance(self, sequences: list[Sequence], tokens: list[int]) -> None:
        """Feed each sampled token to its sequence's matcher; drop finished sequences'."""
        for seq, token in zip(sequences, tokens, strict=True):
            matcher = self._matchers.get(seq.seq_id)
            if matcher is None:
                continue
            if seq.status is SeqStatus.FINISHED:
                del self._matchers[seq.seq_id]
            elif not matcher.is_terminated() and not matcher.accept_token(token):
                log.warning("sequence %d: sampled token %d outside its grammar", seq.seq_id, token)

    def drop(self, seq_id: int) -> None:
        self._matchers.pop(seq_id, None)
