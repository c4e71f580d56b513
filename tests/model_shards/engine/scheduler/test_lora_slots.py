"""LoRA adapter slots on rank 0: every chunk runs with its request's adapter (a slot is never
refilled under a running sequence), requests wait for a slot, idle slots are reused least
recently released first, and prefix-cache hits never cross adapters."""

from __future__ import annotations

import pytest

from model_shards.engine.scheduler import Scheduler
from model_shards.engine.scheduler.lora_slots import LoraSlots
from model_shards.messages import LoraRef
from tests.model_shards.engine.scheduler.sim import (
    FakeWorker,
    config,
    drive,
    make_request,
    reference,
)

A, B, C = (LoraRef(i, name, f"/adapters/{name}") for i, name in enumerate("abc"))
PROMPT = [(5 * i) % 61 + 1 for i in range(24)]  # 6 full blocks of 4


def test_every_chunk_runs_with_its_adapter_and_requests_wait_for_a_slot() -> None:
    loras = [A, B, C, A, None, C, B]
    requests = [
        make_request(f"r{i}", [i + 1, *PROMPT[: 5 + i]], max_tokens=6 + i, seed=i, lora=lora)
        for i, lora in enumerate(loras)
    ]
    sched = Scheduler(config(max_loras=2))
    run = drive(sched, requests)
    for req in requests:
        assert run.outputs[req.request_id] == reference(req)[0]
    holder: dict[int, LoraRef] = {}  # what the ranks' slots hold, step by step
    loads = 0
    for step in run.steps:
        for load in step.lora_loads:
            holder[load.slot] = load.lora
            loads += 1
        assert {load.slot for load in step.lora_loads} <= {0, 1}
        for chunk, seq in zip(step.chunks, step.sequences, strict=True):
            lora = seq.request.lora
            assert chunk.lora_slot == -1 if lora is None else holder[chunk.lora_slot] == lora
        assert len({s.request.lora for s in step.sequences} - {None}) <= 2
    assert loads > 2  # three adapters through two slots


def test_an_idle_slot_keeps_its_adapter_and_the_least_recently_released_goes() -> None:
    slots = LoraSlots(2)
    assert slots.acquire(A) == (0, True)
    assert slots.acquire(B) == (1, True)
    assert slots.acquire(C) is None  # both in use: C waits
    slots.release(1)
    slots.release(0)  # B released first, then A
    assert slots.acquire(A) == (0, False)  # still there: nothing to load
    assert slots.acquire(C) == (1, True)  # B's slot, the idle one
    assert (slots.holder(1), slots.users(0)) == (C, 1)


def test_prefix_cache_hits_stay_within_one_adapter() -> None:
    sched = Scheduler(config(max_loras=2))
    worker = FakeWorker(sched.config.num_blocks, sched.config.block_size)  # one KV pool
    hits = []
    for i, lora in enumerate([A, B, A, None]):
        before = sched.stats.prefix_cache_hit_tokens
        drive(sched, [make_request(f"p{i}", PROMPT, max_tokens=2, seed=i, lora=lora)], None, worker)
        hits.append(sched.stats.prefix_cache_hit_tokens - before)
    assert hits == [
        0,
        0,
        20,
        0,
    ]  # only A's second run hits A's blocks (5 of 6: the last recomputes)


def test_a_request_for_an_adapter_needs_an_engine_with_slots() -> None:
    with pytest.raises(ValueError, match="LoRA adapter 'a': this engine serves none"):
        Scheduler(config()).add(make_request("x", PROMPT, lora=A))
