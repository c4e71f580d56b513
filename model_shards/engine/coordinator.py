"""Rank 0's loop: take requests, schedule, run a step on every rank, report tokens.

The engine step is three verbs — schedule, run, update::

    step = scheduler.schedule()          # rank 0 alone decides
    broadcast_plan(plan); worker.execute # every rank runs its stage
    scheduler.update(step, tokens)       # tokens back to the frontends

A request with a grammar waits in :mod:`model_shards.engine.structured` until it compiles (off
this loop, with a deadline); each plan then carries the token masks of its constrained
sequences, computed in mask threads while the loop runs (a sequence is held out of steps until
its mask is ready; one whose mask is overdue ends with an ``EngineError``).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable

import msgspec

from model_shards.config.speculative import SpeculativeConfig
from model_shards.engine.engine_port import PortSettings
from model_shards.engine.in_flight import InFlight, resolve_async
from model_shards.engine.prompt_logprobs import PromptLogprobTracker
from model_shards.engine.replies import (
    by_client,
    engine_stats,
    first_rows,
    with_logprobs,
    with_stats,
)
from model_shards.engine.request_checks import content_problem
from model_shards.engine.request_trace import RequestTraces
from model_shards.engine.scheduler.scheduler import (
    ScheduledStep,
    Scheduler,
    SchedulerConfig,
    SchedulerStats,
    Sequence,
    SeqUpdate,
)
from model_shards.engine.speculative.proposer import BatchProposer, served
from model_shards.engine.structured.compile_pool import COMPILE_TIMEOUT_S, GrammarError
from model_shards.engine.structured.constraints import Constraints
from model_shards.engine.zmq_loop import Reply, serve_frontends
from model_shards.layers.moe import ExpertTokenSampler
from model_shards.messages import (
    AbortRequests,
    EngineError,
    EngineReady,
    FrontendMessage,
    GenerateRequest,
    MediaInput,
    NewSequence,
    RequestOutput,
    StepPlan,
    SubmitBatch,
)
from model_shards.worker.decoder_worker import Worker, broadcast_plan

log = logging.getLogger(__name__)


class Coordinator:
    def __init__(
        self,
        worker: Worker,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        enable_prefix_caching: bool = True,
        pipeline_overlap: bool = True,
        keepalive_s: float = 10.0,
        model_dir: str | None = None,
        grammar_compile_timeout_s: float = COMPILE_TIMEOUT_S,
        scheduling_policy: str = "fcfs",
        speculative: SpeculativeConfig | None = None,
        draft: BatchProposer | None = None,
        async_scheduling: bool | None = None,
    ) -> None:
        """``model_dir``: where grammars find ``tokenizer.json`` (``None``: grammars refused);
        ``grammar_compile_timeout_s``: a grammar compiling longer is refused; ``speculative``:
        proposals verified in each step (:mod:`model_shards.engine.speculative`), ``draft``
        making them when it names a draft ``model``; ``async_scheduling``: plan each step
        before the previous one's tokens are back (``None``: where the backend queues work;
        :func:`~model_shards.engine.in_flight.resolve_async`)."""
        self.worker = worker
        self.ps = worker.ps
        cfg = worker.model.config
        self.vocab_size = cfg.vocab_size
        self.max_model_len = max_model_len
        self.eos_token_ids = cfg.eos_token_ids
        spec = served(speculative, own_positions=worker.positions is not None)
        self.async_scheduling = resolve_async(async_scheduling, worker, spec is not None)
        limits = SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            block_size=worker.kv.block_size,
            num_blocks=worker.kv.num_blocks,
            kv_windows=worker.kv.layout.windows,
            enable_prefix_caching=enable_prefix_caching,
            eos_token_ids=cfg.eos_token_ids,
            scheduling_policy=scheduling_policy,
            max_loras=0 if worker.lora is None else worker.lora.opts.max_loras,
            speculative=spec,
            async_scheduling=self.async_scheduling,
        )
        self.scheduler = Scheduler(limits, draft if spec is not None else None)
        self.keepalive_s = keepalive_s
        self._expert_tokens = ExpertTokenSampler(worker.model)  # MoE routing, for /metrics
        self._step_id = 0
        self._last_plan_at = time.monotonic()
        self.micro_batches = self.ps.pp_size if pipeline_overlap else 1
        # async scheduling: the step in flight and the next, planned before its tokens are back
        self.max_in_flight = 2 if self.async_scheduling else self.micro_batches
        self._in_flight: deque[InFlight] = deque()
        self.constraints = Constraints.for_model(
            model_dir, cfg.vocab_size, cfg.eos_token_ids, grammar_compile_timeout_s
        )
        self._refused: list[Reply] = []  # constrained requests refused once their grammar was known
        self.traces = RequestTraces()  # opt-in TTFT stamps (GenerateRequest.trace)
        self.prompt_scores = PromptLogprobTracker()  # GenerateRequest.prompt_logprobs

    # ---- in-process API (used by serve() and by tests) ----------------------

    def check_request(self, req: GenerateRequest) -> str | None:
        """Why the engine refuses ``req`` beyond the scheduler's checks, or ``None``
        (:mod:`model_shards.engine.request_checks`, the model's optional ``media_problem``)."""
        problem = content_problem(req, self.vocab_size)
        check: Callable[[MediaInput], str | None] | None
        check = getattr(self.worker.model, "media_problem", None)
        if problem is None and check is not None:
            found = ((i, check(m)) for i, m in enumerate(req.media))
            problem = next((f"media[{i}]: {p}" for i, p in found if p is not None), None)
        if problem is None and req.lora is not None and self.worker.lora is not None:
            problem = self.worker.lora.problem(req.lora)  # never a rank's crash later
        return problem

    def add_request(self, req: GenerateRequest, client: bytes = b"") -> None:
        """Queue ``req``; ``ValueError`` naming the problem if refused. A constrained request
        meets the scheduler's checks once compiled, refused then through :meth:`replies`."""
        problem = self.check_request(req)
        if problem:
            raise ValueError(problem)
        if req.grammar is None:
            self.scheduler.add(req, client)
            return
        if self.constraints is None:
            raise ValueError("this engine has no tokenizer to compile grammars with")
        self.constraints.submit(req, client)  # the scheduler's checks once it is compiled

    def _admit_compiled(self) -> None:
        """Queue constrained requests whose grammar and first mask are ready, refuse failed
        ones; release sequences whose next mask is ready, end those whose mask is past its
        deadline (idle: wait a few ms for a compile or mask first)."""
        c = self.constraints
        if c is None or not c.has_waiting():
            return
        if not self.scheduler.has_schedulable() and not self._in_flight:
            c.wait(0.005)
        for ready in c.ready():
            error = ready.error
            if ready.lane is not None:
                try:
                    seq = self.scheduler.add(ready.request, ready.client)
                except ValueError as exc:
                    self._refused.append(
                        (ready.client, EngineError(str(exc), ready.request.request_id))
                    )
                else:
                    c.attach(seq, ready.lane)
            elif error is not None:
                self._refuse(ready.client, ready.request.request_id, error)
        released, overdue = c.settle()
        for seq_id in released:
            self.scheduler.release(seq_id)
        for seq_id, error in overdue:
            self._end_too_slow(seq_id, error)

    def _refuse(self, client: bytes, request_id: str, error: GrammarError) -> None:
        self._refused.append((client, EngineError(str(error), request_id, error.code)))

    def _end_too_slow(self, seq_id: int, error: GrammarError) -> None:
        """End the request of held sequence ``seq_id``: its grammar's mask is overdue."""
        self.scheduler.release(seq_id)
        seq = next((s for s in self.scheduler.running if s.seq_id == seq_id), None)
        if seq is None:
            return
        log.warning("%s", error)
        self.abort([seq.request_id])
        self._refuse(seq.client, seq.request_id, error)

    def abort(self, request_ids: list[str], client: bytes | None = None) -> list[SeqUpdate]:
        """Forget ``request_ids`` (with ``client``: only those that client submitted)."""
        updates = []
        for rid in request_ids:
            if client is not None and self._client_of(rid) != client:
                continue
            self.traces.drop(rid)
            seq = self.scheduler.abort(rid)
            if seq is None and self.constraints is not None:
                waiting = self.constraints.abort(rid)  # still compiling: never queued
                seq = (
                    None
                    if waiting is None
                    else Sequence(-1, waiting[0], waiting[0].sampling, waiting[1])
                )
            if seq is None:
                continue
            self.prompt_scores.drop(seq.seq_id)
            self.scheduler.release(seq.seq_id)
            if self.constraints is not None:
                self.constraints.drop(seq.seq_id)
            updates.append(SeqUpdate(seq, RequestOutput(rid, [], "abort")))
        return updates

    def _client_of(self, request_id: str) -> bytes | None:
        """The frontend that submitted a live request, or ``None``."""
        client = self.scheduler.client_of(request_id)
        if client is None and self.constraints is not None:
            client = self.constraints.client_of(request_id)
        return client

    def has_work(self) -> bool:
        waiting = self.constraints is not None and self.constraints.has_waiting()
        return self.scheduler.has_work() or bool(self._in_flight) or waiting

    @property
    def stats(self) -> SchedulerStats:
        return self.scheduler.stats

    def step(self) -> list[SeqUpdate]:
        """One iteration, not overlapped: schedule, run on every rank, update (after the
        steps still in flight)."""
        updates: list[SeqUpdate] = []
        while self._in_flight:
            updates += self._finish(self._in_flight.popleft())
        self._admit_compiled()
        launched = self._launch()
        return updates + (self._finish(launched) if launched is not None else [])

    def pump(self) -> list[SeqUpdate]:
        """Keep up to ``max_in_flight`` steps (micro-batches of disjoint sequences, one per
        stage; or with async scheduling, the step in flight and the next, which the scheduler
        may run ahead of it) in the pipeline, then finish the oldest."""
        self._admit_compiled()
        while len(self._in_flight) < self.max_in_flight and self.scheduler.has_schedulable():
            if self._in_flight and not self._may_follow(self._in_flight[-1]):
                break  # some sequence waits for its token: finish that step first
            launched = self._launch()
            if launched is None:
                break
            self._in_flight.append(launched)
        return self._finish(self._in_flight.popleft()) if self._in_flight else []

    def _may_follow(self, step: InFlight) -> bool:
        """Whether the next step may be launched while ``step`` runs: pipeline micro-batches
        always (disjoint sequences), async scheduling when the scheduler runs ahead of it."""
        return not self.async_scheduling or self.scheduler.runs_ahead_of(step.scheduled)

    def _launch(self) -> InFlight | None:
        """Schedule a step, send its plan, run stage 0; ``None`` when it ran no chunk."""
        scheduled = self.scheduler.schedule(self.micro_batches)
        trace = self.traces.step(scheduled.sequences)  # OFF unless a traced request runs
        sampled = [
            seq for seq, c in zip(scheduled.sequences, scheduled.chunks, strict=True) if c.sample
        ]
        plan = StepPlan(
            step_id=self._next_step_id(),
            chunks=self.prompt_scores.plan(scheduled.chunks, scheduled.sequences),
            new_sequences=self._with_stop_ids(scheduled),
            freed_seq_ids=scheduled.freed_seq_ids,
            token_masks=[] if self.constraints is None else self.constraints.masks(sampled),
            lora_loads=scheduled.lora_loads,
        )
        broadcast_plan(plan, self.worker.comm, self.worker.pending)
        self._last_plan_at = time.monotonic()
        trace.stamp("plan_sent")
        result = self.worker.execute(plan, wait=False, trace=trace)
        if not plan.chunks:
            return None
        return InFlight(scheduled, plan, sampled, result)

    def _finish(self, step: InFlight) -> list[SeqUpdate]:
        """Wait for a launched step's tokens and apply them."""
        result = step.result.get() if step.result is not None else self.worker.collect(step.plan)
        updates = self.scheduler.update(step.scheduled, result.tokens)
        # each sampled chunk's first row: the one token of a chunk without drafts
        firsts = first_rows(step.plan.chunks)
        if self.constraints is not None:
            tokens = [result.tokens[i] for i in firsts[:-1]]
            for seq_id in self.constraints.advance(step.sampled, tokens):
                self.scheduler.hold(seq_id)  # until its next mask is ready
        self.prompt_scores.record(
            step.plan.chunks, step.scheduled.sequences, result.prompt_logprobs
        )
        if result.logprobs is not None:
            updates = with_logprobs(updates, step.sampled, firsts, result.logprobs)
        return self.traces.attach(self.prompt_scores.attach(updates))

    def _with_stop_ids(self, scheduled: ScheduledStep) -> list[NewSequence]:
        """Tell the sampler which tokens to mask while ``min_tokens`` are not yet out."""
        requests = {seq.seq_id: seq.request for seq in scheduled.sequences}
        out = []
        for new in scheduled.new_sequences:
            req = requests[new.seq_id]
            if req.sampling.min_tokens > 0:
                stops = list(req.stop_token_ids)
                if not req.ignore_eos:
                    stops += self.eos_token_ids
                new = msgspec.structs.replace(new, stop_token_ids=sorted(set(stops)))
            out.append(new)
        return out

    def keepalive(self) -> None:
        """Broadcast an empty plan (and pending frees) if none went out for ``keepalive_s``, so
        the ranks' collective timeout fires only on a real failure."""
        if time.monotonic() - self._last_plan_at >= self.keepalive_s or (
            self.scheduler.has_pending_frees()
        ):
            self.step()

    def shutdown(self) -> None:
        """Finish the steps in flight, then tell every rank to leave its loop."""
        while self._in_flight:
            self._finish(self._in_flight.popleft())
        broadcast_plan(
            StepPlan(step_id=self._next_step_id(), shutdown=True),
            self.worker.comm,
            self.worker.pending,
        )
        self.worker.pending.wait_all()
        if self.constraints is not None:
            self.constraints.close()

    def _next_step_id(self) -> int:
        self._step_id += 1
        return self._step_id

    # ---- FrontendEngine (model_shards.engine.zmq_loop) ---------------------------

    def ready(self) -> EngineReady:
        return EngineReady(self.max_model_len, self.vocab_size, list(self.eos_token_ids))

    def handle(self, message: FrontendMessage, client: bytes) -> list[Reply]:
        if isinstance(message, SubmitBatch):
            received = time.monotonic_ns()
            refused: list[Reply] = []
            for req in message.requests:
                try:
                    self.add_request(req, client)
                except ValueError as exc:
                    refused.append((client, EngineError(str(exc), req.request_id)))
                except Exception:  # a check that broke: refuse this request, keep serving
                    log.exception("request %r could not be checked", req.request_id)
                    refused.append((client, EngineError("request refused", req.request_id)))
                else:
                    self.traces.open(req, received)  # kept only if req.trace
            return refused
        if isinstance(message, AbortRequests):  # blocks are released now: report it
            return self._with_stats(by_client(self.abort(message.request_ids, client)))
        return [(client, EngineError(f"this replica generates; cannot {type(message).__name__}"))]

    def work(self) -> list[Reply]:
        updates = self.pump()
        if not self.scheduler.has_work() and not self._in_flight:
            self.keepalive()  # only grammars compiling: the ranks still hear from rank 0
        return self.replies(updates)

    def replies(self, updates: list[SeqUpdate]) -> list[Reply]:
        """What the frontends get for a step's ``updates`` (with the engine's counters),
        after the constrained requests refused since the last call."""
        replies = self._with_stats(by_client(updates))
        refused, self._refused = self._refused, []
        return refused + replies

    def _with_stats(self, replies: list[Reply]) -> list[Reply]:
        """Attach the current engine counters to every ``StepOutputs`` in ``replies``."""
        if not replies:
            return replies
        media = self.worker.media
        cache = (media.stats.hits, media.stats.misses) if media else (0, 0)
        return with_stats(replies, engine_stats(self.stats, cache, self._expert_tokens.sample()))

    def serve(self, address: str, settings: PortSettings) -> None:
        """Serve frontends on a ZMQ ROUTER at ``address`` until ``Shutdown``; then stop ranks."""
        serve_frontends(self, address, settings)
