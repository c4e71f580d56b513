"""Automatic prefix caching: hits, accounting, the last-block cap, LRU eviction."""

from __future__ import annotations

from model_shards.engine.scheduler import Scheduler
from model_shards.engine.scheduler.block_manager import BlockManager
from model_shards.engine.scheduler.prefix_cache import hash_block
from model_shards.messages import GenerateRequest
from tests.model_shards.engine.scheduler.sim import (
    FakeWorker,
    config,
    drive,
    make_request,
    reference,
)

SYSTEM = [(7 * i) % 61 + 1 for i in range(32)]  # 8 full blocks of 4


def shared_prefix_requests() -> list[GenerateRequest]:
    first = make_request("first", [*SYSTEM, 60, 61, 62], max_tokens=5, seed=1)
    rest = [
        make_request(f"q{i}", [*SYSTEM, i + 1, *range(2, 2 + i)], max_tokens=8, seed=10 + i)
        for i in range(10)
    ]
    return [first, *rest]


def test_shared_prefix_is_served_from_cache() -> None:
    requests = shared_prefix_requests()
    arrivals = [0] + [20] * 10  # the first finishes (and is cached) before the rest arrive
    on = Scheduler(config())
    off = Scheduler(config(enable_prefix_caching=False))
    run_on = drive(on, requests, arrivals)
    run_off = drive(off, requests, arrivals)
    assert run_on.outputs == run_off.outputs
    for req in requests:
        assert run_on.outputs[req.request_id] == reference(req)[0]
    hits = on.stats.prefix_cache_hit_tokens
    assert hits >= 10 * len(SYSTEM)
    assert hits % 4 == 0
    assert on.stats.prefill_tokens_computed == off.stats.prefill_tokens_computed - hits
    assert off.stats.prefix_cache_hit_tokens == 0
    assert off.stats.num_cached_blocks == 0
    arrival_step = run_on.steps[20]  # every admitted sequence starts after the cached prefix
    assert arrival_step.new_sequences
    assert all(c.start_pos >= len(SYSTEM) for c in arrival_step.chunks)


def test_hit_chunk_lists_cached_blocks_then_fresh_ones() -> None:
    sched = Scheduler(config())
    w = FakeWorker(256, 4)
    a = drive(sched, [make_request("a", [*SYSTEM, 1])], worker=w)
    a_blocks = a.steps[0].chunks[0].new_block_ids
    b = drive(sched, [make_request("b", [*SYSTEM, 2, 3])], worker=w)
    chunk = b.steps[0].chunks[0]
    assert chunk.start_pos == 32 and chunk.token_ids == [2, 3]
    assert chunk.new_block_ids[:8] == a_blocks[:8]
    assert len(chunk.new_block_ids) == 9 and chunk.new_block_ids[8] not in a_blocks[:8]


def test_identical_prompt_never_reuses_the_block_of_its_last_token() -> None:
    sched = Scheduler(config())
    w = FakeWorker(256, 4)
    prompt = SYSTEM[:8]  # exactly two full blocks
    drive(sched, [make_request("a", prompt)], worker=w)
    run = drive(sched, [make_request("b", prompt)], worker=w)
    chunk = run.steps[0].chunks[0]
    assert chunk.start_pos == 4 and chunk.token_ids == prompt[4:]  # (8 - 1) // 4 = 1 block hit
    assert sched.stats.prefix_cache_hit_tokens == 4


def test_concurrent_identical_prompts_share_blocks_safely() -> None:
    # The simulated worker checks that shared blocks are full and never written.
    requests = [make_request(f"r{i}", [*SYSTEM, 5], max_tokens=12, seed=i) for i in range(6)]
    sched = Scheduler(config(max_num_batched_tokens=64))
    run = drive(sched, requests, arrivals=[0, 3, 3, 4, 9, 9])
    for req in requests:
        assert run.outputs[req.request_id] == reference(req)[0]
    assert sched.stats.prefix_cache_hit_tokens == 5 * len(SYSTEM)


def test_lru_evicts_least_recently_released_first() -> None:
    # 6 blocks of 4. a and b each cache 2 blocks; c needs 4 blocks: 2 fresh + a's 2.
    sched = Scheduler(config(num_blocks=6, max_num_batched_tokens=16))
    w = FakeWorker(6, 4)
    a, b = [1] * 4 + [2] * 4, [3] * 4 + [4] * 4
    drive(sched, [make_request("a", a, max_tokens=1)], worker=w)
    drive(sched, [make_request("b", b, max_tokens=1)], worker=w)
    drive(sched, [make_request("c", [5] * 16, max_tokens=1)], worker=w)
    before = sched.stats.prefix_cache_hit_tokens
    drive(sched, [make_request("b2", b, max_tokens=1)], worker=w)
    assert sched.stats.prefix_cache_hit_tokens == before + 4  # b survived
    drive(sched, [make_request("a2", a, max_tokens=1)], worker=w)
    assert sched.stats.prefix_cache_hit_tokens == before + 4  # a was evicted


def test_block_manager_lru_and_hit_refresh() -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    blocks = bm.allocate(4)
    hashes = [hash_block(None, [i, i]) for i in range(4)]
    for block, h in zip(blocks, hashes, strict=True):
        bm.register(block, h)
    bm.release(blocks)  # parked in order 0, 1, 2, 3
    assert bm.num_free == 4
    assert bm.cached_prefix([hashes[0]]) == [blocks[0]]
    bm.acquire([blocks[0]])  # a hit: 0 is held again...
    assert bm.num_free == 3
    bm.release([blocks[0]])  # ...and released last: evicted last
    assert bm.cache.parked_in_lru_order() == [blocks[1], blocks[2], blocks[3], blocks[0]]
    assert bm.allocate(2) == [blocks[1], blocks[2]]
    assert bm.cached_prefix([hashes[1]]) == []  # forgotten on eviction
    assert bm.cached_prefix([hashes[3]]) == [blocks[3]]


def test_block_manager_counts_and_errors() -> None:
    bm = BlockManager(num_blocks=3, block_size=4, enable_caching=False)
    got = bm.allocate(3)
    assert sorted(got) == [0, 1, 2] and bm.num_free == 0
    try:
        bm.allocate(1)
    except RuntimeError:
        pass
    else:
        raise AssertionError("allocating from an empty pool must fail")
    bm.register(got[0], hash_block(None, [1, 2, 3, 4]))  # caching off: ignored
    assert len(bm.cache) == 0
    bm.release(got)
    assert bm.num_free == 3
    try:
        bm.release([got[0]])
    except RuntimeError:
        pass
    else:
        raise AssertionError("double release must fail")


def test_duplicate_content_keeps_the_first_block() -> None:
    bm = BlockManager(num_blocks=2, block_size=2)
    x, y = bm.allocate(2)
    h = hash_block(None, [1, 2])
    bm.register(x, h)
    bm.register(y, h)
    assert bm.cached_prefix([h]) == [x]
    bm.release([x, y])
    assert bm.cache.parked_in_lru_order() == [x]  # y went back to the free list
    assert bm.num_free == 2


def test_hash_is_chained_and_stable() -> None:
    h1 = hash_block(None, [1, 2, 3, 4])
    assert h1 == hash_block(None, [1, 2, 3, 4])
    assert hash_block(h1, [5, 6, 7, 8]) != hash_block(None, [5, 6, 7, 8])
    assert hash_block(h1, [5, 6, 7, 8]) != hash_block(hash_block(None, [0, 2, 3, 4]), [5, 6, 7, 8])
    assert len(h1) == 32


def test_choices_of_one_prompt_compute_its_blocks_once() -> None:
    """n > 1: four sequences of the same 18-token prompt arrive together. The first
    computes the prompt; the others wait for its 4 full blocks to be cached, share
    them, and compute only the 2-token tail."""
    prompt = [(5 * i) % 50 + 1 for i in range(18)]
    choices = [make_request(f"c{i}", prompt, max_tokens=6, seed=100 + i) for i in range(4)]
    sched = Scheduler(config(max_num_batched_tokens=64))
    run = drive(sched, choices)
    for req in choices:
        assert run.outputs[req.request_id] == reference(req)[0]
    assert sched.stats.prefix_cache_hit_tokens == 3 * 16
    assert sched.stats.prefill_tokens_computed == 18 + 3 * 2
    # ...while without sharing every choice computes all 18 tokens
    alone = Scheduler(config(max_num_batched_tokens=64, enable_prefix_caching=False))
    drive(alone, choices)
    assert alone.stats.prefill_tokens_computed == 4 * 18
