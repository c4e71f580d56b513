"""Continuous batching, chunked prefill and preemption, driven through the simulated worker."""

from __future__ import annotations

import random

import pytest

from model_shards.engine.scheduler import ScheduledStep, Scheduler
from model_shards.engine.scheduler.prefill import PIPELINE_MIN_PREFILL
from model_shards.messages import GenerateRequest
from tests.model_shards.engine.scheduler.sim import (
    FakeWorker,
    assert_quiescent,
    config,
    drive,
    drive_pipelined,
    make_request,
    reference,
)


def random_requests(
    n: int, seed: int, max_prompt: int = 40, max_tokens: int = 20
) -> list[GenerateRequest]:
    rng = random.Random(seed)
    return [
        make_request(
            f"r{i}",
            [rng.randrange(1, 64) for _ in range(rng.randint(1, max_prompt))],
            rng.randint(1, max_tokens),
            seed=rng.getrandbits(63),
        )
        for i in range(n)
    ]


@pytest.mark.parametrize("caching", [True, False])
def test_concurrent_requests_match_running_alone(caching: bool) -> None:
    requests = random_requests(40, seed=1)
    arrivals = [random.Random(i).randint(0, 30) for i in range(len(requests))]
    sched = Scheduler(config(enable_prefix_caching=caching))
    run = drive(sched, requests, arrivals)
    assert max(len(s.chunks) for s in run.steps) > 4  # really batched
    for req in requests[:5]:  # alone through the scheduler...
        alone = drive(Scheduler(config()), [req])
        assert alone.outputs[req.request_id] == run.outputs[req.request_id]
    for req in requests:  # ...and alone without any scheduler
        assert (run.outputs[req.request_id], run.finish[req.request_id]) == reference(req)
    assert sched.stats.num_preemptions == 0
    assert sched.stats.prefill_tokens_computed == sum(len(r.prompt_token_ids) for r in requests)


def test_chunked_prefill_respects_budget_and_decodes_keep_flowing() -> None:
    budget = 16
    short = [make_request(f"s{i}", [i + 1, 5, 7], max_tokens=60, ignore_eos=True) for i in range(3)]
    long = make_request("long", [(3 * i) % 63 + 1 for i in range(100)], max_tokens=4)
    sched = Scheduler(config(max_num_batched_tokens=budget))
    run = drive(sched, [*short, long], arrivals=[0, 0, 0, 2])
    long_steps = [
        (s, c)
        for s in run.steps
        for c, q in zip(s.chunks, s.sequences, strict=True)
        if q.request_id == "long"
    ]
    prefill = [(s, c) for s, c in long_steps if c.start_pos < 100]
    assert len(prefill) >= 100 // budget  # split over several steps
    assert [c.sample for _, c in prefill] == [False] * (len(prefill) - 1) + [True]
    assert sum(len(c.token_ids) for _, c in prefill) == 100
    assert [c.start_pos for _, c in prefill] == sorted(c.start_pos for _, c in prefill)
    for step, chunk in prefill:
        decodes = [c for c in step.chunks if c is not chunk]
        assert len(decodes) == 3 and all(len(c.token_ids) == 1 for c in decodes)
        assert step.chunks[-1] is chunk  # decodes first
        assert step.num_tokens == budget or chunk.sample
    for req in [*short, long]:
        assert (run.outputs[req.request_id], run.finish[req.request_id]) == reference(req)


def test_first_chunk_of_a_prompt_longer_than_the_budget_runs_with_decodes() -> None:
    sched = Scheduler(config(max_num_batched_tokens=8, max_num_seqs=4))
    run = drive(sched, [make_request("a", [1] * 30, max_tokens=3), make_request("b", [2] * 5)])
    first = run.steps[0]
    assert [len(c.token_ids) for c in first.chunks] == [8]  # a's first chunk, b waits for budget
    assert all(s.num_tokens <= 8 for s in run.steps)


@pytest.mark.parametrize("caching", [True, False])
def test_small_pool_preempts_and_every_request_completes_identically(caching: bool) -> None:
    requests = random_requests(32, seed=7)
    sched = Scheduler(config(num_blocks=16, enable_prefix_caching=caching))
    worker = FakeWorker(16, 4)
    run = drive(sched, requests, worker=worker)
    stats = sched.stats
    assert stats.num_preemptions > 0
    assert max(worker.announced.values()) >= 2  # resent as NewSequence after preemption
    for req in requests:
        assert (run.outputs[req.request_id], run.finish[req.request_id]) == reference(req)
    freed_then_new = [
        s for s in run.steps if set(s.freed_seq_ids) & {n.seq_id for n in s.new_sequences}
    ]
    assert not freed_then_new  # nothing is resumed in the step that preempted it
    if not caching:
        assert stats.prefix_cache_hit_tokens == 0


def test_preemption_takes_the_newest_and_resumes_it_first() -> None:
    # 4 blocks of 4: two sequences of 6 prompt tokens fill 4 blocks once both decode past 8.
    a = make_request("a", [1] * 6, max_tokens=9, ignore_eos=True)
    b = make_request("b", [2] * 6, max_tokens=9, ignore_eos=True)
    sched = Scheduler(config(num_blocks=4, enable_prefix_caching=False))
    run = drive(sched, [a, b])
    assert sched.stats.num_preemptions >= 1
    preempting = next(s for s in run.steps if s.freed_seq_ids)
    assert preempting.freed_seq_ids == [1]  # b, the newest
    assert [q.request_id for q in preempting.sequences] == ["a"]
    resumed = [s for s in run.steps if any(n.seq_id == 1 for n in s.new_sequences)][1]
    chunk = next(c for c in resumed.chunks if c.seq_id == 1)
    assert chunk.start_pos == 0 and len(chunk.token_ids) > 6  # prompt + generated so far
    assert resumed.new_sequences[0].num_prompt_tokens == 6
    for req in (a, b):
        assert run.outputs[req.request_id] == reference(req)[0]


def test_a_sequence_in_an_unfinished_step_is_never_preempted() -> None:
    # 2 blocks of 4: a and b take one each, in two steps in flight at once; a's first decode
    # then needs a third block, and b (newer, but still in flight) must not be the victim.
    a = make_request("a", [1] * 4, max_tokens=4, ignore_eos=True)
    b = make_request("b", [2] * 4, max_tokens=4, ignore_eos=True)
    sched = Scheduler(config(max_num_seqs=2, num_blocks=2, enable_prefix_caching=False))
    sched.add(a)
    sched.add(b)
    first, second = sched.schedule(micro_batches=2), sched.schedule(micro_batches=2)
    assert [[s.request_id for s in step.sequences] for step in (first, second)] == [["a"], ["b"]]
    sched.update(first, [7])
    third = sched.schedule(micro_batches=2)
    assert third.freed_seq_ids == [0]  # a gives way itself
    assert third.chunks == []


def test_tokens_must_match_sampled_chunks() -> None:
    sched = Scheduler(config())
    sched.add(make_request("a", [1, 2, 3]))
    step = sched.schedule()
    with pytest.raises(ValueError, match="sampled 1 chunks but got 0"):
        sched.update(step, [])


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["serial", "async"])
@pytest.mark.parametrize("trial", range(40))
def test_random_workloads_with_aborts(trial: int, async_scheduling: bool) -> None:
    """Random pool, budget and block sizes, shared prefixes, arrivals and aborts; with async
    scheduling (the next step planned before the last one's tokens are known) the same."""
    rng = random.Random(trial)
    bs, nb, seqs = rng.choice([1, 2, 4, 8]), rng.randint(4, 40), rng.randint(1, 8)
    cfg = config(
        block_size=bs,
        num_blocks=nb,
        max_num_seqs=seqs,
        max_num_batched_tokens=rng.randint(seqs, 40),
        max_model_len=rng.randint(8, 80),
        enable_prefix_caching=rng.random() < 0.7,
        async_scheduling=async_scheduling,
    )
    shared = [rng.randrange(1, 64) for _ in range(30)]
    requests: list[GenerateRequest] = []
    while len(requests) < 20:
        n, max_tokens = rng.randint(1, 40), rng.randint(1, 25)
        prompt = shared[:n] if rng.random() < 0.5 else [rng.randrange(1, 64) for _ in range(n)]
        kv = min(n + max_tokens, cfg.max_model_len) - 1
        if n < cfg.max_model_len and -(-kv // bs) <= nb:  # else add() refuses it
            requests.append(
                make_request(f"r{len(requests)}", prompt, max_tokens, seed=rng.getrandbits(32))
            )
    aborts = {rng.randint(0, 40): [f"r{rng.randrange(20)}"] for _ in range(4)}
    sched = Scheduler(cfg)
    run = drive(sched, requests, [rng.randint(0, 15) for _ in requests], aborts=aborts)
    for req in requests:
        if run.finish[req.request_id] != "abort":
            want = reference(req, max_model_len=cfg.max_model_len)
            assert (run.outputs[req.request_id], run.finish[req.request_id]) == want


def test_pipeline_micro_batches_split_the_live_sequences() -> None:
    """With two micro-batches in flight, each step takes half the live sequences, so the
    second micro-batch is never empty; outputs are unchanged."""
    requests = [make_request(f"r{i}", [i + 1, 9], max_tokens=6, ignore_eos=True) for i in range(8)]
    sched = Scheduler(config(max_num_seqs=8))
    worker = FakeWorker(sched.config.num_blocks, sched.config.block_size)
    for req in requests:
        sched.add(req)
    sizes = []

    def record(step: ScheduledStep) -> None:
        assert step.chunks, "a schedulable sequence was left out"
        sizes.append(len(step.chunks))

    outputs = drive_pipelined(sched, worker, 2, record)
    assert sizes[:4] == [4, 4, 4, 4]  # halves, not one batch of 8 and an empty second
    for req in requests:
        assert outputs[req.request_id] == reference(req)[0]
    assert_quiescent(sched, worker)


@pytest.mark.parametrize("micro_batches", [2, 1])
def test_pipeline_takes_a_burst_of_prompts_in_shrinking_chunks(micro_batches: int) -> None:
    """With micro-batches in flight, a step's prompt tokens are capped at a quarter (two
    micro-batches) of the prompt tokens not yet scheduled, never below
    PIPELINE_MIN_PREFILL; one micro-batch takes the whole budget. Outputs are unchanged."""
    prompt_len, n = 100, 40
    requests = [
        make_request(f"r{i}", [i + 1] * prompt_len, 4, ignore_eos=True) for i in range(n)
    ]  # no prefix shared: every prompt token is computed
    cfg = config(max_num_seqs=n, max_num_batched_tokens=4096, num_blocks=1200)
    sched = Scheduler(cfg)
    worker = FakeWorker(cfg.num_blocks, cfg.block_size)
    for req in requests:
        sched.add(req)
    prompt_tokens: list[int] = []  # per step

    def record(step: ScheduledStep) -> None:
        took = sum(
            max(0, min(c.start_pos + len(c.token_ids), prompt_len) - c.start_pos)
            for c in step.chunks
        )
        if micro_batches > 1:  # at most the seats' slack over the cap
            backlog = n * prompt_len - sum(prompt_tokens)
            cap = max(PIPELINE_MIN_PREFILL, -(-backlog // (2 * micro_batches)))
            assert took <= n // micro_batches + cap, (took, backlog)
        prompt_tokens.append(took)

    outputs = drive_pipelined(sched, worker, micro_batches, record)
    for req in requests:
        assert outputs[req.request_id] == reference(req)[0]
    assert sum(prompt_tokens) == n * prompt_len
    if micro_batches == 2:
        # a quarter of 4000 (and the seats' slack), then a quarter of what is left
        assert 1000 <= prompt_tokens[0] <= 1020
        head = prompt_tokens[:5]
        assert head == sorted(head, reverse=True) and head[-1] < 400
    else:
        assert prompt_tokens[0] == n * prompt_len  # the whole burst in one step
    assert_quiescent(sched, worker)
