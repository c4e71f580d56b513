"""``--scheduling-policy priority`` (vLLM's): lower ``priority`` is admitted first and preempted
last, a waiting request that outranks a running one takes its seat, and every request still
generates what it generates alone; ``fcfs`` ignores the field."""

from __future__ import annotations

import pytest

from model_shards.engine.scheduler import Scheduler
from tests.model_shards.engine.scheduler.sim import config, drive, make_request, reference


def _requests() -> list:  # type: ignore[type-arg]
    prompts = {"a": ([1] * 6, 0), "b": ([2] * 6, 5), "c": ([3] * 6, -1), "d": ([4] * 6, 5)}
    return [
        make_request(rid, prompt, max_tokens=6, ignore_eos=True, priority=prio)
        for rid, (prompt, prio) in prompts.items()
    ]


@pytest.mark.parametrize(
    ("policy", "order"), [("fcfs", "abcd"), ("priority", "cabd")], ids=["fcfs", "priority"]
)
def test_one_seat_serves_by_priority_and_outranked_work_yields(policy: str, order: str) -> None:
    requests = _requests()  # a runs alone from step 0; b, c, d arrive at step 2
    sched = Scheduler(config(max_num_seqs=1, scheduling_policy=policy))
    run = drive(sched, requests, arrivals=[0, 2, 2, 2])
    assert "".join(run.finish) == order
    if policy == "priority":  # a (0) gave c (-1) its seat, and resumed before b and d (5)
        assert sched.stats.num_preemptions == 1
    for req in requests:
        assert run.outputs[req.request_id] == reference(req)[0]


def test_a_block_shortage_preempts_the_lowest_priority_not_the_newest() -> None:
    # 4 blocks of 4: a and b (6 prompt tokens each) need a third block each past 8 tokens
    a = make_request("a", [1] * 6, max_tokens=9, ignore_eos=True, priority=5)
    b = make_request("b", [2] * 6, max_tokens=9, ignore_eos=True, priority=0)
    sched = Scheduler(
        config(num_blocks=4, enable_prefix_caching=False, scheduling_policy="priority")
    )
    run = drive(sched, [a, b])
    preempting = next(s for s in run.steps if s.freed_seq_ids)
    assert preempting.freed_seq_ids == [0]  # a, the older: fcfs would take b (the newest)
    for req in (a, b):
        assert run.outputs[req.request_id] == reference(req)[0]


def test_an_unknown_policy_is_refused_by_flag_name() -> None:
    with pytest.raises(ValueError, match="--scheduling-policy"):
        config(scheduling_policy="lottery")
