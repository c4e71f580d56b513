"""Continuous batching with chunked prefill over a paged, prefix-cached KV pool.

One step (``schedule``) packs, within ``max_num_seqs`` sequences and
``max_num_batched_tokens`` tokens:

1. every running *decode* (1 token each), oldest admission first;
2. the next chunk of every running, partially prefilled sequence;
3. new (or preempted) waiting sequences, first come first served: each starts
   after its prefix-cache hit and gets as much of its prompt as the token
   budget allows. The rest of the prompt follows in later steps (chunked
   prefill, ``sample=False`` until the chunk that reaches the last token).
   A sequence whose next full prompt block a running sequence is computing
   right now (``n > 1`` choices of one prompt, identical prompts) waits until
   that block is cached, then shares it.

KV blocks are taken as tokens are scheduled. When a running sequence needs
a block and none is free (after evicting parked cached blocks), the newest
running sequence not already in this step is *preempted*: its blocks are
released, its id goes out in this step's ``freed_seq_ids`` (ranks drop it
before running chunks), and it returns to the front of the waiting queue with
its output so far. Resumed, it is announced again with ``NewSequence`` and
recomputed over prompt + output (the ranks' sampler is deterministic per
position, so the output continues unchanged). No new sequence is admitted in
a step that preempted.

Several steps may be in flight (pipeline micro-batches): a sequence in an
unfinished step is neither scheduled nor preempted until ``update(step,
tokens)`` records that step's sampled tokens. ``update`` advances the KV
cursor, offers newly computed full blocks to the prefix cache, appends
tokens and decides finishes. Steps run on every stage in the order they were
scheduled, so a block released by an abort can be handed to a later step at
once.

Invariant: a block is written only by the one sequence that holds it. Shared
blocks are full, computed, cached blocks: a hit never covers the block of the
last token to compute (at most ``(len - 1) // block_size`` blocks hit), and
only full blocks are ever cached.
"""

from __future__ import annotations

import random
from collections import deque

import msgspec

from model_shards.messages import (
    FinishReason,
    GenerateRequest,
    NewSequence,
    RequestOutput,
    SeqChunk,
)
from model_shards.scheduler.block_manager import BlockManager
from model_shards.scheduler.config import SchedulerConfig, SchedulerStats
from model_shards.scheduler.sequence import ScheduledStep, SeqStatus, Sequence, SeqUpdate

# The smallest prompt-token cap of a pipeline micro-batch. Measured on the benchmark's 135M
# model, pp=2 on two CPU cores, bursts of 32 prompts of 32 tokens: 256-token steps cut the
# time stage 0 waits on stage 1 from 1.7 s to 0.9 s per 64 requests; 64-token steps cut
# it further (0.7 s) but ran the prompts 20% slower, eating the gain.
PIPELINE_MIN_PREFILL = 256


class _StepBuilder:
    """The step being assembled: chunks, their sequences, and the token budget."""

    def __init__(self, budget: int, seats: int, freed: list[int]) -> None:
        self.budget = budget
        self.seats = seats  # sequences this step may still take
        self.chunks: list[SeqChunk] = []
        self.sequences: list[Sequence] = []
        self.new_sequences: list[NewSequence] = []
        self.freed = freed
        self.scheduled: set[int] = set()
        self.preempted = False

    def add(self, seq: Sequence, start: int, end: int, new_blocks: list[int]) -> None:
        sample = end == len(seq.token_ids)
        self.chunks.append(
            SeqChunk(seq.seq_id, start, seq.token_ids[start:end], sample, new_blocks)
        )
        self.sequences.append(seq)
        self.scheduled.add(seq.seq_id)
        self.budget -= end - start
        self.seats -= 1

    @property
    def full(self) -> bool:
        return self.budget == 0 or self.seats == 0

    def build(self) -> ScheduledStep:
        return ScheduledStep(self.chunks, self.sequences, self.new_sequences, self.freed, [])


class Scheduler:
    """Rank 0's scheduler; see the module docstring for the policy."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.blocks = BlockManager(
            config.num_blocks, config.block_size, config.enable_prefix_caching
        )
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order, oldest first
        self._by_request: dict[str, Sequence] = {}
        self._to_free: list[int] = []
        self._next_seq_id = 0
        self._eos = frozenset(config.eos_token_ids)
        self._rng = random.Random()
        self._prefill_tokens = 0
        self._hit_tokens = 0
        self._preemptions = 0
        self._in_flight: set[int] = set()  # seq ids of scheduled steps not yet updated

    # ---- requests in and out ------------------------------------------------

    def add(self, request: GenerateRequest, client: bytes = b"") -> Sequence:
        """Queue ``request``. ``ValueError`` if its id is live or it can never run.

        "Never": an empty prompt, ``max_tokens < 1``, a prompt of
        ``max_model_len`` tokens or more, or a sequence whose KV at its longest
        (``min(prompt + max_tokens, max_model_len) - 1`` tokens; the last
        sampled token is never computed) exceeds the whole pool, so that every
        accepted sequence can finish once it runs alone.
        A request without a seed gets a random one here: ranks never draw their own.
        """
        self._check(request)
        sampling = request.sampling
        if sampling.seed is None:
            sampling = msgspec.structs.replace(sampling, seed=self._rng.getrandbits(63))
        seq = Sequence(
            self._next_seq_id, request, sampling, client,
            output_ids=list(request.resume_output_ids),
        )  # fmt: skip
        self._next_seq_id += 1
        self.waiting.append(seq)
        self._by_request[request.request_id] = seq
        return seq

    def abort(self, request_id: str) -> Sequence | None:
        """Forget a live request (its blocks are released now); ``None`` if unknown."""
        seq = self._by_request.get(request_id)
        if seq is None:
            return None
        if seq.status is SeqStatus.RUNNING:
            self._retire(seq)
        else:
            self.waiting.remove(seq)
            del self._by_request[request_id]
            seq.status = SeqStatus.FINISHED
        return seq

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def has_pending_frees(self) -> bool:
        """Finished or aborted sequences whose ids the ranks have not been told yet."""
        return bool(self._to_free)

    @property
    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            prefill_tokens_computed=self._prefill_tokens,
            prefix_cache_hit_tokens=self._hit_tokens,
            num_preemptions=self._preemptions,
            num_free_blocks=self.blocks.num_free,
            num_cached_blocks=len(self.blocks.cache),
            num_blocks=self.config.num_blocks,
            num_running=len(self.running),
            num_waiting=len(self.waiting),
        )

    # ---- the step -----------------------------------------------------------

    def schedule(self, micro_batches: int = 1) -> ScheduledStep:
        """Decide the next step (see the module docstring). May be empty.

        ``micro_batches > 1`` (pipeline overlap): the step takes at most its share,
        ``ceil(live / micro_batches)``, of the live sequences (running plus those
        that could be admitted), so that the others fill the next micro-batches
        instead of leaving the pipeline with one batch in flight. Its prompt tokens
        are also capped at ``ceil(backlog / (2 * micro_batches))`` (not below
        ``PIPELINE_MIN_PREFILL``), ``backlog`` being the prompt tokens not yet
        scheduled: the later stages idle while the first one runs the first step,
        and the pipeline drains unevenly behind the last expensive one, so a burst
        of prompts goes in as shrinking chunks rather than two large micro-batches.
        """
        live = min(self.config.max_num_seqs, len(self.running) + len(self.waiting))
        seats = -(-live // micro_batches)  # with one micro-batch: every live sequence
        budget = self.config.max_num_batched_tokens
        if micro_batches > 1:
            prefill_cap = max(PIPELINE_MIN_PREFILL, -(-self._backlog() // (2 * micro_batches)))
            budget = min(budget, seats + prefill_cap)  # a seat's decode costs one token
        step = _StepBuilder(budget, seats, self._to_free)
        self._to_free = []
        for seq in list(self.running):
            if step.full:
                break
            if self._ready(seq, step) and not seq.is_prefilling:
                self._schedule_decode(seq, step)
        for seq in list(self.running):
            if step.full:
                break
            if self._ready(seq, step) and seq.is_prefilling:
                self._schedule_prefill(seq, step)
        while not step.preempted and self._admit(step):
            pass
        self._in_flight |= step.scheduled
        return step.build()

    def _backlog(self) -> int:
        """Prompt tokens not yet scheduled (waiting sequences, unfinished prefills)."""
        waiting = sum(len(seq.token_ids) for seq in self.waiting)
        return waiting + sum(
            len(seq.token_ids) - seq.num_computed
            for seq in self.running
            if seq.is_prefilling and seq.seq_id not in self._in_flight
        )

    def has_schedulable(self) -> bool:
        """Whether a ``schedule()`` now could run anything (waiting, or running not in flight)."""
        return bool(self.waiting) or any(s.seq_id not in self._in_flight for s in self.running)

    def _ready(self, seq: Sequence, step: _StepBuilder) -> bool:
        return (
            seq.status is SeqStatus.RUNNING
            and seq.seq_id not in step.scheduled
            and seq.seq_id not in self._in_flight
        )

    def update(self, step: ScheduledStep, tokens: list[int]) -> list[SeqUpdate]:
        """Record a step's results; ``tokens``: one per ``sample`` chunk, in chunk order.

        Returns one update per sampled chunk of a sequence still live (those
        aborted meanwhile are skipped). Finished sequences release their blocks
        now; their ids go out with the next step's ``freed_seq_ids``.
        """
        num_sampled = sum(1 for c in step.chunks if c.sample)
        if len(tokens) != num_sampled:
            raise ValueError(f"step sampled {num_sampled} chunks but got {len(tokens)} tokens")
        sampled = iter(tokens)
        self._in_flight.difference_update(c.seq_id for c in step.chunks)
        updates = []
        for seq, chunk in zip(step.sequences, step.chunks, strict=True):
            token = next(sampled) if chunk.sample else None
            if (
                seq.status is not SeqStatus.RUNNING
                or self._by_request.get(seq.request_id) is not seq
            ):
                continue
            seq.num_computed = chunk.start_pos + len(chunk.token_ids)
            self._register_computed_blocks(seq)
            if token is None:
                continue
            seq.append_token(token)
            reason = self._finish_reason(seq, token)
            first = len(seq.output_ids) == 1
            output = RequestOutput(
                seq.request_id, [token], reason, seq.num_prompt_tokens if first else 0
            )
            if reason is not None:
                self._retire(seq)
            updates.append(SeqUpdate(seq, output))
        return updates

    # ---- scheduling pieces --------------------------------------------------

    def _schedule_decode(self, seq: Sequence, step: _StepBuilder) -> None:
        end = seq.num_computed + 1
        need = self.blocks.blocks_for(end) - len(seq.block_table)
        if self._make_room(seq, need, step):
            self._extend_and_add(seq, end, step)

    def _schedule_prefill(self, seq: Sequence, step: _StepBuilder) -> None:
        """The next prompt chunk, shrunk to the blocks that can be had (preempting if none)."""
        bs = self.config.block_size
        table_full = len(seq.block_table) * bs == seq.num_computed
        if not self._make_room(seq, 1 if table_full else 0, step):
            return
        capacity = (len(seq.block_table) + self.blocks.num_free) * bs - seq.num_computed
        n = min(len(seq.token_ids) - seq.num_computed, step.budget, capacity)
        self._extend_and_add(seq, seq.num_computed + n, step)

    def _admit(self, step: _StepBuilder) -> bool:
        """Start the first waiting sequence if a seat, budget and blocks allow it."""
        if not self.waiting or step.full or len(self.running) >= self.config.max_num_seqs:
            return False
        seq = self.waiting[0]
        bs = self.config.block_size
        hits: list[int] = []
        if self.config.enable_prefix_caching:
            max_hits = (len(seq.token_ids) - 1) // bs
            hits = self.blocks.cached_prefix(seq.block_hashes(max_hits, bs))
            if len(hits) < max_hits and self._being_computed(seq, len(hits)):
                return False  # wait a step and share those blocks instead of recomputing
        start = len(hits) * bs
        end = start + min(len(seq.token_ids) - start, step.budget)
        need = self.blocks.blocks_for(end) - len(hits)
        if need > self.blocks.num_free - self.blocks.num_parked_among(hits):
            return False
        self.waiting.popleft()
        self.blocks.acquire(hits)
        seq.block_table = hits + self.blocks.allocate(need)
        seq.num_computed = start
        seq.prefill_end = len(seq.token_ids)
        seq.num_registered_blocks = len(hits)
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)
        self._hit_tokens += start
        self._prefill_tokens += end - start
        step.new_sequences.append(NewSequence(seq.seq_id, seq.sampling, seq.num_prompt_tokens))
        step.add(seq, start, end, list(seq.block_table))
        return True

    def _extend_and_add(self, seq: Sequence, end: int, step: _StepBuilder) -> None:
        self._prefill_tokens += max(0, min(end, seq.prefill_end) - seq.num_computed)
        new_blocks = self.blocks.allocate(self.blocks.blocks_for(end) - len(seq.block_table))
        seq.block_table.extend(new_blocks)
        step.add(seq, seq.num_computed, end, new_blocks)

    def _make_room(self, seq: Sequence, need: int, step: _StepBuilder) -> bool:
        """Preempt newest unscheduled sequences until ``need`` blocks are free.

        ``False`` if ``seq`` itself had to go.
        """
        while self.blocks.num_free < need:
            victim = next(
                (
                    s
                    for s in reversed(self.running)
                    if s.seq_id not in step.scheduled and s.seq_id not in self._in_flight
                ),
                None,
            )
            if victim is None:  # everyone else is in flight: wait for them
                return False
            self._preempt(victim, step)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence, step: _StepBuilder) -> None:
        self.running.remove(seq)
        self._release_blocks(seq)
        seq.num_computed = 0
        seq.num_registered_blocks = 0
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)
        step.freed.append(seq.seq_id)
        step.preempted = True
        self._preemptions += 1

    def _being_computed(self, seq: Sequence, index: int) -> bool:
        """Whether a running sequence is computing ``seq``'s full prompt block ``index``
        (same chained hash, so the same tokens up to there) and will cache it.

        The ``n`` choices of one prompt, and identical prompts arriving together,
        then compute the shared blocks once: the first runs, the others wait for
        the blocks to land in the prefix cache.
        """
        bs = self.config.block_size
        (*_, want) = seq.block_hashes(index + 1, bs)
        return any(
            s.num_computed < (index + 1) * bs <= s.prefill_end
            and s.num_registered_blocks <= index
            and s.block_hashes(index + 1, bs)[index] == want
            for s in self.running
        )

    # ---- bookkeeping --------------------------------------------------------

    def _register_computed_blocks(self, seq: Sequence) -> None:
        """Offer the sequence's newly computed full blocks to the prefix cache."""
        if not self.config.enable_prefix_caching:
            return
        bs = self.config.block_size
        full = seq.num_computed // bs
        hashes = seq.block_hashes(full, bs)
        for i in range(seq.num_registered_blocks, full):
            self.blocks.register(seq.block_table[i], hashes[i])
        seq.num_registered_blocks = max(seq.num_registered_blocks, full)

    def _retire(self, seq: Sequence) -> None:
        """A running sequence is done (finished or aborted): release and forget it."""
        self.running.remove(seq)
        self._release_blocks(seq)
        del self._by_request[seq.request_id]
        self._to_free.append(seq.seq_id)
        seq.status = SeqStatus.FINISHED

    def _release_blocks(self, seq: Sequence) -> None:
        # Tail first, so a sequence's deepest cached blocks are evicted before its
        # shared-prefix blocks (an evicted parent would make its children unreachable).
        self.blocks.release(reversed(seq.block_table))
        seq.block_table = []

    def _finish_reason(self, seq: Sequence, token: int) -> FinishReason | None:
        req = seq.request
        num_out = len(seq.output_ids)
        if num_out >= seq.sampling.min_tokens and (
            token in req.stop_token_ids or (not req.ignore_eos and token in self._eos)
        ):
            return "stop"
        if num_out >= req.max_tokens or len(seq.token_ids) >= self.config.max_model_len:
            return "length"
        return None

    def _check(self, request: GenerateRequest) -> None:
        cfg = self.config
        rid = request.request_id
        n = len(request.prompt_token_ids)
        if rid in self._by_request:
            raise ValueError(f"request id {rid!r} is already running")
        if n == 0:
            raise ValueError(f"request {rid!r}: prompt is empty")
        if request.max_tokens < 1:
            raise ValueError(f"request {rid!r}: max_tokens must be >= 1")
        if n >= cfg.max_model_len:
            raise ValueError(
                f"request {rid!r}: prompt has {n} tokens; the context window is {cfg.max_model_len}"
            )
        kv_tokens = min(n + request.max_tokens, cfg.max_model_len) - 1
        if self.blocks.blocks_for(kv_tokens) > cfg.num_blocks:
            raise ValueError(
                f"request {rid!r}: {n} prompt + up to {request.max_tokens} new tokens need "
                f"{kv_tokens} KV slots, more than the whole cache ({cfg.num_blocks} blocks "
                f"of {cfg.block_size}); lower max_tokens or give the KV cache more memory"
            )
