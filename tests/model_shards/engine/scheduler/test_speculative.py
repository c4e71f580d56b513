"""Speculative decoding in the scheduler, on the simulated worker of :mod:`.sim`.

The fake model here repeats itself (the token ``PERIOD`` back) except where a seeded hash says
otherwise, so n-gram proposals are often right and sometimes wrong. With and without
speculation every request must produce the same tokens and finish the same way, since the
sampler is per position: under preemption (a pool of few blocks), with prefix-cache hits
(requests sharing a prompt arriving later), with stop tokens and ``max_tokens`` falling inside
an accepted run. After every step: each block registered in the prefix cache holds the
sequence's own tokens (never a rejected draft), and no sequence's table reaches past the
blocks its computed positions need (the ranks' tables are cut the same way); afterwards
every block is free. Drafts stop above ``disable_by_batch_size`` and after a run of rejections;
a sequence under a grammar never takes any. A draft model (:class:`FakeDraft`: one batch of
proposals a step) changes no output either, and is told of every sequence that leaves.
"""

from __future__ import annotations

import dataclasses
import random

import msgspec
import pytest

from model_shards.config.speculative import SpeculativeConfig
from model_shards.engine.scheduler import Scheduler, Sequence
from model_shards.engine.speculative.ngram import NgramIndex
from model_shards.engine.speculative.proposer import PAUSE_STEPS, SeqProposer
from model_shards.engine.speculative.verify import accepted_run
from model_shards.messages import GenerateRequest, GrammarSpec, SamplingParams
from tests.model_shards.engine.scheduler.sim import VOCAB, FakeWorker, assert_quiescent, config

PERIOD = 5
NGRAM = SpeculativeConfig("ngram", 4, prompt_lookup_max=3, prompt_lookup_min=1)


class RepeatingWorker(FakeWorker):
    """A model that mostly copies the token ``PERIOD`` back (1 in 6 positions: a hash)."""

    def next_token(self, seed: int, tokens: list[int]) -> int:
        if len(tokens) >= PERIOD and hash((seed, len(tokens))) % 6:
            return tokens[-PERIOD]
        return hash((seed, tuple(tokens))) % VOCAB


def _requests(n: int, seed: int = 0) -> list[GenerateRequest]:
    rng = random.Random(seed)
    shared = [rng.randrange(1, VOCAB) for _ in range(12)]
    out = []
    for i in range(n):
        prompt = shared + [rng.randrange(1, VOCAB) for _ in range(rng.randrange(1, 9))]
        stops = [rng.randrange(1, VOCAB)] if i % 3 == 0 else []
        out.append(
            GenerateRequest(
                f"r{i}",
                prompt,
                rng.randrange(8, 40),
                SamplingParams(seed=i),
                stop_token_ids=stops,
                ignore_eos=i % 2 == 0,
            )
        )
    return out


def _drive(sched: Scheduler, requests: list[GenerateRequest]) -> dict[str, object]:
    """Requests arrive two a step; checks the cache and the tables after every step."""
    cfg = sched.config
    worker = RepeatingWorker(cfg.num_blocks, cfg.block_size)
    outputs: dict[str, list[int]] = {r.request_id: [] for r in requests}
    finish: dict[str, str] = {}
    pending = list(requests)
    for _ in range(5000):
        for req in pending[:2]:
            sched.add(req)
        pending = pending[2:]
        step = sched.schedule()
        for update in sched.update(step, worker.execute(step)):
            outputs[update.output.request_id] += update.output.new_token_ids
            if update.output.finish_reason is not None:
                finish[update.output.request_id] = update.output.finish_reason
        for seq in sched.running:
            _check_seq(sched, worker, seq)
        if not pending and not sched.has_work():
            break
    worker.execute(sched.schedule())  # the last frees
    assert_quiescent(sched, worker)
    return {"outputs": outputs, "finish": finish, "stats": sched.stats}


def _check_seq(sched: Scheduler, worker: FakeWorker, seq: Sequence) -> None:
    bs = sched.config.block_size
    assert len(seq.block_table) <= max(1, -(-(seq.num_computed + 1) // bs)) or seq.is_prefilling
    registered = seq.num_registered_blocks * bs
    if registered and seq.seq_id in worker.tables:
        assert worker.read(seq.seq_id, registered) == seq.token_ids[:registered]


@pytest.mark.parametrize(
    "overrides",
    [
        {},  # plenty of blocks, prefix hits
        {"num_blocks": 24, "enable_prefix_caching": False},  # preemption
        {"num_blocks": 30},  # preemption and prefix hits
        {"max_num_batched_tokens": 12, "max_num_seqs": 4},  # chunked prefill, tight budget
    ],
)
def test_speculation_changes_no_output(overrides: dict[str, object]) -> None:
    requests = _requests(12)
    spec = dataclasses.replace(NGRAM, disable_by_batch_size=64)
    plain = _drive(Scheduler(config(**overrides)), requests)
    fast = _drive(Scheduler(config(**overrides, speculative=spec)), requests)
    assert fast["outputs"] == plain["outputs"]
    assert fast["finish"] == plain["finish"]
    counts = fast["stats"].spec  # type: ignore[attr-defined]
    assert counts.accepted_tokens > 0 and counts.draft_tokens > counts.accepted_tokens
    assert sum(counts.accepted_per_pos) == counts.accepted_tokens
    assert plain["stats"].spec.drafts == 0  # type: ignore[attr-defined]
    if overrides.get("num_blocks"):
        assert fast["stats"].num_preemptions > 0  # type: ignore[attr-defined]
    if overrides.get("enable_prefix_caching", True):
        assert fast["stats"].prefix_cache_hit_tokens > 0  # type: ignore[attr-defined]


class FakeDraft:
    """A draft model's stand-in: each sequence's tokens ``PERIOD`` back, in one batch a step."""

    def __init__(self) -> None:
        self.live: set[int] = set()
        self.batches = 0

    def propose(self, wants: dict[int, tuple[list[int], int]]) -> dict[int, list[int]]:
        self.batches += 1
        out = {}
        for seq_id, (tokens, k) in wants.items():
            self.live.add(seq_id)
            ahead = list(tokens)
            for _ in range(k):
                ahead.append(ahead[-PERIOD])
            out[seq_id] = ahead[len(tokens) :]
        return out

    def free(self, seq_ids: list[int]) -> None:
        self.live.difference_update(seq_ids)


def test_draft_model_changes_no_output() -> None:
    requests, overrides = _requests(12), {"num_blocks": 30}
    spec = SpeculativeConfig("draft_model", 3, disable_by_batch_size=64, model="draft")
    draft = FakeDraft()
    plain = _drive(Scheduler(config(**overrides)), requests)
    fast = _drive(Scheduler(config(**overrides, speculative=spec), draft), requests)
    assert fast["outputs"] == plain["outputs"] and fast["finish"] == plain["finish"]
    stats = fast["stats"]
    assert 0 < stats.spec.accepted_tokens < stats.spec.draft_tokens  # type: ignore[attr-defined]
    assert stats.num_preemptions > 0 and stats.prefix_cache_hit_tokens > 0  # type: ignore[attr-defined]
    assert draft.batches > 0 and not draft.live  # every sequence freed in the draft too
    with pytest.raises(ValueError, match="go together"):
        Scheduler(config(speculative=spec))


def test_no_drafts_above_the_batch_size() -> None:
    spec = dataclasses.replace(NGRAM, disable_by_batch_size=2)
    sched = Scheduler(config(speculative=spec))
    worker = RepeatingWorker(sched.config.num_blocks, sched.config.block_size)
    for req in _requests(4):
        sched.add(req)
    drafts_at: dict[int, int] = {}
    while sched.has_work():
        running = len(sched.running)
        step = sched.schedule()
        drafts_at[running] = drafts_at.get(running, 0) + sum(c.num_draft for c in step.chunks)
        sched.update(step, worker.execute(step))
    assert drafts_at.get(3, 0) == drafts_at.get(4, 0) == 0
    assert drafts_at.get(1, 0) + drafts_at.get(2, 0) > 0


def test_accept_rule_and_stop_inside_a_run() -> None:
    assert accepted_run([4, 5, 6], [4, 5, 6, 7]) == [4, 5, 6, 7]  # all, and the bonus
    assert accepted_run([4, 5, 6], [4, 9, 6, 7]) == [4, 9]  # the first miss is emitted
    assert accepted_run([], [3]) == [3]
    # a stop token accepted mid-run ends the output there
    sched = Scheduler(config(speculative=NGRAM))
    req = GenerateRequest("s", [1, 2, 3, 4, 1, 2], 20, SamplingParams(seed=0), stop_token_ids=[1])
    sched.add(req)
    sched.update(sched.schedule(), [3])  # the prompt, then 3
    step = sched.schedule()  # decode 3 with the drafts that followed (1, 2, 3) in the prompt
    (chunk,) = step.chunks
    assert chunk.token_ids == [3, 4, 1, 2, 3] and chunk.num_draft == 4
    (update,) = sched.update(step, [4, 1, 2, 9, 9])  # 4, stop token 1 accepted, then more
    assert update.output.new_token_ids == [4, 1] and update.output.finish_reason == "stop"
    sched.schedule()  # tells the ranks
    assert_quiescent(sched)


def test_ngram_index_and_the_gate() -> None:
    index = NgramIndex(1, 3)
    tokens = [7, 8, 9, 1, 7, 8]
    assert index.propose(tokens, 3) == [9, 1, 7]  # (7, 8) occurred at 0
    tokens += [2, 8]
    assert index.propose(tokens, 2) == [2, 8]  # (8,) last occurred before 2: the latest match
    assert NgramIndex(2, 2).propose([1, 2, 3], 4) == []
    # a sequence whose drafts are always wrong pauses proposing
    p = SeqProposer.for_config(NGRAM)
    for _ in range(10):
        if p.pause:
            break
        p.record(0)
    assert p.pause == PAUSE_STEPS
    assert p.propose([1, 2, 1], 4) == []


def test_constrained_sequences_take_no_drafts() -> None:
    """A grammar masks one position a step: its sequences decode one token at a time."""
    sched = Scheduler(config(speculative=NGRAM))
    worker = RepeatingWorker(sched.config.num_blocks, sched.config.block_size)
    grammar = GrammarSpec("regex", "[a-z]+")
    for req in _requests(4):
        sched.add(msgspec.structs.replace(req, grammar=grammar))
    while sched.has_work():
        step = sched.schedule()
        assert all(c.num_draft == 0 for c in step.chunks)
        sched.update(step, worker.execute(step))
    assert sched.stats.spec.drafts == 0
