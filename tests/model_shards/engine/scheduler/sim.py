"""A fake model and a simulated worker that check every plan the scheduler emits.

The simulated worker mirrors what the ranks do with a plan: it keeps a block
table per sequence from ``new_block_ids`` / ``freed_seq_ids``, "writes KV" —
``(position, token)`` — into ``table[p // bs] * bs + p % bs``, and samples the
next token from the KV it *reads back through the block table*. A block table
that points at the wrong or an overwritten block therefore changes the
output, besides failing the explicit checks:

* every chunk's positions are covered by its table, and the table holds no
  more blocks than those positions need;
* positions before ``start_pos`` are already in the KV cache;
* a block written this step belongs to the writing sequence alone; a block in
  two live tables is full (shared, cached, never written again).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import msgspec

from model_shards.engine.scheduler import ScheduledStep, Scheduler, SchedulerConfig
from model_shards.messages import FinishReason, GenerateRequest, SamplingParams, SeqChunk

VOCAB = 64
EOS = 0


def fake_next_token(seed: int, tokens: Sequence[int]) -> int:
    """A deterministic "model": the next token is a function of the seed and every token."""
    return hash((seed, tuple(tokens))) % VOCAB  # int tuples hash the same in every run


def reference(
    request: GenerateRequest, eos: Iterable[int] = (EOS,), max_model_len: int = 10**9
) -> tuple[list[int], FinishReason]:
    """What one request generates alone, without any scheduler."""
    assert request.sampling.seed is not None
    eos_set = set(eos)
    tokens = list(request.prompt_token_ids)
    out: list[int] = []
    while True:
        t = fake_next_token(request.sampling.seed, tokens)
        out.append(t)
        tokens.append(t)
        if len(out) >= request.sampling.min_tokens and (
            t in request.stop_token_ids or (not request.ignore_eos and t in eos_set)
        ):
            return out, "stop"
        if len(out) >= request.max_tokens or len(tokens) >= max_model_len:
            return out, "length"


def make_request(
    rid: str, prompt: list[int], max_tokens: int = 16, seed: int | None = 0, **kw: object
) -> GenerateRequest:
    return GenerateRequest(rid, prompt, max_tokens, SamplingParams(seed=seed), **kw)  # type: ignore[arg-type]


class FakeWorker:
    """Every rank's view of the plans, reduced to block tables and a fake KV pool."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.bs = block_size
        self.kv: list[tuple[int, int] | None] = [None] * (num_blocks * block_size)
        self.tables: dict[int, list[int]] = {}
        self.seeds: dict[int, int] = {}
        self.announced: Counter[int] = Counter()  # NewSequence count per seq_id
        self._seed_of: dict[int, int] = {}  # survives frees: a resent sequence keeps its seed
        self.sampled: list[int] = []  # the last step's tokens

    def execute(self, step: ScheduledStep) -> list[int]:
        for seq_id in step.freed_seq_ids:
            assert seq_id in self.tables, f"freed unknown sequence {seq_id}"
            del self.tables[seq_id], self.seeds[seq_id]
        for new in step.new_sequences:
            assert new.seq_id not in self.tables, f"sequence {new.seq_id} announced twice"
            seed = new.sampling.seed
            assert seed is not None, "rank 0 must always send a seed"
            assert self._seed_of.setdefault(new.seq_id, seed) == seed, "seed changed on resend"
            self.tables[new.seq_id] = []
            self.seeds[new.seq_id] = seed
            self.announced[new.seq_id] += 1
        ids = [c.seq_id for c in step.chunks]
        assert len(ids) == len(set(ids)), "a sequence has two chunks in one step"
        chunks = [self._resolve(c) for c in step.chunks]
        for chunk in chunks:
            assert chunk.seq_id in self.tables, f"chunk for unannounced sequence {chunk.seq_id}"
            if chunk.table_len >= 0:  # rolled-back drafts' blocks
                del self.tables[chunk.seq_id][chunk.table_len :]
            self.tables[chunk.seq_id].extend(chunk.new_block_ids)
        owners: dict[int, set[int]] = {}
        for seq_id, table in self.tables.items():
            assert len(table) == len(set(table)), f"sequence {seq_id} holds a block twice"
            for block in table:
                owners.setdefault(block, set()).add(seq_id)
        for chunk in chunks:
            self._write(chunk.seq_id, chunk.start_pos, chunk.token_ids, owners)
        for block, holders in owners.items():
            if len(holders) > 1:
                assert all(self._slot_filled(block, i) for i in range(self.bs)), (
                    f"block {block} shared by {holders} is not full"
                )
        self.sampled = [  # a verify chunk samples after each of its last 1 + num_draft positions
            self._sample(c.seq_id, c.start_pos + len(c.token_ids) - c.num_draft + j)
            for c in chunks
            if c.sample
            for j in range(1 + c.num_draft)
        ]
        return self.sampled

    def _resolve(self, chunk: SeqChunk) -> SeqChunk:
        """``chunk`` with its future token (async scheduling: ``-(1 + i)``, the previous
        step's ``i``-th sample) read from what that step sampled, as the ranks do."""
        if all(t >= 0 for t in chunk.token_ids):
            return chunk
        (future,) = chunk.token_ids  # a one-token decode chunk, and it samples
        assert chunk.sample and -future <= len(self.sampled), (chunk, self.sampled)
        return msgspec.structs.replace(chunk, token_ids=[self.sampled[-1 - future]])

    def _write(
        self, seq_id: int, start: int, tokens: list[int], owners: dict[int, set[int]]
    ) -> None:
        table = self.tables[seq_id]
        end = start + len(tokens)
        assert tokens, "empty chunk"
        assert len(table) == -(-end // self.bs), (
            f"seq {seq_id}: table of {len(table)} blocks for positions 0..{end - 1}"
        )
        for p in range(start):
            entry = self.kv[self._slot(table, p)]
            assert entry is not None and entry[0] == p, f"seq {seq_id}: position {p} not cached"
        for p, token in zip(range(start, end), tokens, strict=True):
            block = table[p // self.bs]
            assert owners[block] == {seq_id}, (
                f"seq {seq_id} writes block {block} of {owners[block]}"
            )
            self.kv[self._slot(table, p)] = (p, token)

    def _sample(self, seq_id: int, end: int) -> int:
        return self.next_token(self.seeds[seq_id], self.read(seq_id, end))

    def read(self, seq_id: int, end: int) -> list[int]:
        """The tokens of positions ``0 .. end - 1`` read back through the block table."""
        table = self.tables[seq_id]
        tokens = []
        for p in range(end):
            entry = self.kv[self._slot(table, p)]
            assert entry is not None and entry[0] == p
            tokens.append(entry[1])
        return tokens

    def next_token(self, seed: int, tokens: list[int]) -> int:
        """The fake model (a subclass may use another)."""
        return fake_next_token(seed, tokens)

    def _slot(self, table: list[int], p: int) -> int:
        return table[p // self.bs] * self.bs + p % self.bs

    def _slot_filled(self, block: int, i: int) -> bool:
        return self.kv[block * self.bs + i] is not None


@dataclass
class Run:
    """What a driven scenario produced."""

    outputs: dict[str, list[int]] = field(default_factory=dict)
    finish: dict[str, FinishReason] = field(default_factory=dict)
    steps: list[ScheduledStep] = field(default_factory=list)


def drive(
    sched: Scheduler,
    requests: Sequence[GenerateRequest],
    arrivals: Sequence[int] | None = None,
    worker: FakeWorker | None = None,
    max_steps: int = 20_000,
    aborts: Mapping[int, Sequence[str]] | None = None,
) -> Run:
    """Run ``requests`` (request ``i`` added before step ``arrivals[i]``) to completion.

    ``aborts[k]``: request ids aborted before step ``k`` (recorded as finish "abort"). With
    ``async_scheduling`` the next step is scheduled (and run) before the last one's tokens are
    applied whenever the scheduler allows it, as the coordinator's pump does.

    Checks each step's limits, that outputs arrive once per sampled chunk and
    finish once, and that afterwards every block is free and the worker holds
    no sequence.
    """
    cfg = sched.config
    worker = worker or FakeWorker(cfg.num_blocks, cfg.block_size)
    arrivals = arrivals or [0] * len(requests)
    pending = sorted(zip(arrivals, range(len(requests)), strict=True), reverse=True)
    run = Run()
    in_flight: list[tuple[ScheduledStep, list[int]]] = []  # run, tokens not applied yet
    idle = 0
    while True:
        while in_flight and (
            len(in_flight) > 1
            or not sched.runs_ahead_of(in_flight[-1][0])
            or not sched.has_schedulable()
        ):
            _apply(sched, *in_flight.pop(0), run)
        if not (pending or sched.has_work() or sched.has_pending_frees()):
            break
        while pending and pending[-1][0] <= len(run.steps):
            req = requests[pending.pop()[1]]
            sched.add(req)
            run.outputs[req.request_id] = []
        for rid in (aborts or {}).get(len(run.steps), ()):
            if sched.abort(rid) is not None:
                run.finish[rid] = "abort"
        step = sched.schedule()
        run.steps.append(step)
        assert len(step.chunks) == len(step.sequences)
        assert len(step.chunks) <= cfg.max_num_seqs
        assert step.num_tokens <= cfg.max_num_batched_tokens
        idle = idle + 1 if not step.chunks and sched.has_work() else 0
        assert idle < 3, "scheduler made no progress"
        in_flight.append((step, worker.execute(step)))
        assert len(run.steps) < max_steps
    assert_quiescent(sched, worker)
    return run


def _apply(sched: Scheduler, step: ScheduledStep, tokens: list[int], run: Run) -> None:
    """``step``'s tokens into the scheduler, its outputs into ``run`` (checked)."""
    for update in sched.update(step, tokens):
        out = update.output
        rid = out.request_id
        assert rid not in run.finish, f"{rid} got output after finishing"
        assert out.num_prompt_tokens == (
            len(update.sequence.request.prompt_token_ids) if not run.outputs[rid] else 0
        )
        run.outputs[rid].extend(out.new_token_ids)
        if out.finish_reason is not None:
            run.finish[rid] = out.finish_reason


def drive_pipelined(
    sched: Scheduler,
    worker: FakeWorker,
    micro_batches: int,
    on_schedule: Callable[[ScheduledStep], None] = lambda step: None,
) -> dict[str, list[int]]:
    """Run every request already added to its end with up to ``micro_batches`` steps in
    flight, as the coordinator's pump does, calling ``on_schedule`` on each step as it is
    scheduled. Returns each request's tokens; the worker has been told the last frees."""
    outputs: dict[str, list[int]] = {}
    in_flight: list[ScheduledStep] = []
    while sched.has_work() or in_flight:
        while len(in_flight) < micro_batches and sched.has_schedulable():
            step = sched.schedule(micro_batches=micro_batches)
            on_schedule(step)
            in_flight.append(step)
        done = in_flight.pop(0)
        for update in sched.update(done, worker.execute(done)):
            outputs.setdefault(update.output.request_id, []).extend(update.output.new_token_ids)
    worker.execute(sched.schedule(micro_batches=micro_batches))
    return outputs


def assert_quiescent(sched: Scheduler, worker: FakeWorker | None = None) -> None:
    """Nothing live: every block back in the pool, no ids left to free."""
    stats = sched.stats
    assert stats.num_free_blocks == stats.num_blocks == sched.config.num_blocks
    assert stats.num_running == stats.num_waiting == 0
    assert not sched.has_pending_frees()
    assert all(sched.blocks.ref_count(b) == 0 for b in range(sched.config.num_blocks))
    if worker is not None:
        assert worker.tables == {}


def config(**overrides: object) -> SchedulerConfig:
    base: dict[str, object] = dict(
        max_num_seqs=8,
        max_num_batched_tokens=32,
        max_model_len=512,
        block_size=4,
        num_blocks=256,
        eos_token_ids=(EOS,),
    )
    base.update(overrides)
    return SchedulerConfig(**base)  # type: ignore[arg-type]
