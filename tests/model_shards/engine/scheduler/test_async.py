"""Async scheduling: step N+1 is scheduled (and run) before step N's tokens are applied.

Driven through the simulated worker, which reads a future token from what the previous step
sampled, as the ranks do: outputs equal a run alone without any scheduler, with chunked
prefill, prefix hits, preemption and stops; a sequence that must wait for its token (grammar,
penalties) is never run ahead; every block comes back.
"""

from __future__ import annotations

import random

import msgspec
import pytest

from model_shards.engine.scheduler import Scheduler
from model_shards.engine.scheduler.ahead import future_token
from model_shards.messages import GrammarSpec, SamplingParams
from tests.model_shards.engine.scheduler.sim import EOS, config, drive, make_request, reference


def _runs_ahead(chunk_tokens: list[int]) -> bool:
    return any(t < 0 for t in chunk_tokens)


@pytest.mark.parametrize("caching", [True, False])
def test_async_outputs_equal_serial_with_prefill_hits_and_preemption(caching: bool) -> None:
    rng = random.Random(3)
    shared = [rng.randrange(1, 64) for _ in range(24)]
    requests = [
        make_request(
            f"r{i}",
            shared[: rng.randint(1, 24)]
            + [rng.randrange(1, 64) for _ in range(rng.randint(1, 30))],
            rng.randint(1, 24),
            seed=rng.getrandbits(63),
        )
        for i in range(32)
    ]
    arrivals = [rng.randint(0, 20) for _ in requests]
    for blocks in (256, 24):  # roomy, then a pool that preempts
        cfg = config(num_blocks=blocks, enable_prefix_caching=caching, async_scheduling=True)
        sched = Scheduler(cfg)
        run = drive(sched, requests, arrivals)
        ahead = [c for step in run.steps for c in step.chunks if _runs_ahead(c.token_ids)]
        assert len(ahead) > len(requests), "sequences should follow on while in flight"
        for req in requests:
            assert (run.outputs[req.request_id], run.finish[req.request_id]) == reference(req)
        if blocks == 24:
            assert sched.stats.num_preemptions > 0
        if caching:
            assert sched.stats.prefix_cache_hit_tokens > 0


def test_a_stop_in_flight_drops_the_token_after_it() -> None:
    """The step after a stop token runs that sequence once more; its token is never sent."""
    stopping = [make_request(f"s{i}", [i + 5, 9, 11], max_tokens=50, seed=i) for i in range(40)]
    stopping = [r for r in stopping if reference(r)[1] == "stop"][:4]
    assert stopping, "some seeds should reach EOS within 50 tokens"
    sched = Scheduler(config(async_scheduling=True))
    run = drive(sched, stopping)
    for req in stopping:
        out, reason = reference(req)
        assert run.outputs[req.request_id] == out and out[-1] == EOS and reason == "stop"
    ran = sum(len(c.token_ids) for step in run.steps for c in step.chunks)
    useful = sum(len(r.prompt_token_ids) + len(run.outputs[r.request_id]) - 1 for r in stopping)
    assert ran == useful + len(stopping), "one wasted row per stopped sequence"


def test_length_limit_is_not_run_past() -> None:
    req = make_request("a", [1, 2, 3], max_tokens=5, ignore_eos=True)
    run = drive(Scheduler(config(async_scheduling=True)), [req])
    assert run.outputs["a"] == reference(req)[0] and len(run.outputs["a"]) == 5
    positions = [c.start_pos for step in run.steps for c in step.chunks]
    assert positions == [0, 3, 4, 5, 6], "no row past the fifth token"


def test_sequences_waiting_on_their_token_are_never_run_ahead() -> None:
    plain = make_request("plain", [1, 2], max_tokens=8, ignore_eos=True)
    penalised = msgspec.structs.replace(
        make_request("pen", [3, 4], max_tokens=8, ignore_eos=True),
        sampling=SamplingParams(seed=1, presence_penalty=0.5),
    )
    grammar = msgspec.structs.replace(
        make_request("gram", [5, 6], max_tokens=8, ignore_eos=True),
        grammar=GrammarSpec("regex", "a+"),
    )
    sched = Scheduler(config(async_scheduling=True))
    for req in (plain, penalised, grammar):
        sched.add(req)
    first = sched.schedule()
    assert not sched.runs_ahead_of(first), "two of its sequences must wait for their tokens"
    second = sched.schedule()
    assert [c.token_ids for c in second.chunks] == [[future_token(0)]], "only plain follows on"
