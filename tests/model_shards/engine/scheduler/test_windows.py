"""The scheduler with sliding-window KV groups (Gemma's): one table per group, the
windowed tables releasing what left every later query's window, one pool for all."""

from __future__ import annotations

from collections import Counter

import pytest

from model_shards.config.kv_layout import peak_blocks, window_start
from model_shards.engine.scheduler import Scheduler, SchedulerConfig
from model_shards.messages import GenerateRequest, SamplingParams

BS = 4
WINDOW = 6
WINDOWS = (None, WINDOW, WINDOW)  # a global group and two sliding ones


def _scheduler(num_blocks: int, max_batched: int = 16) -> Scheduler:
    config = SchedulerConfig(
        max_num_seqs=8,
        max_num_batched_tokens=max_batched,
        max_model_len=256,
        block_size=BS,
        num_blocks=num_blocks,
        kv_windows=WINDOWS,
    )
    return Scheduler(config)


def _request(rid: str, prompt_len: int, new: int) -> GenerateRequest:
    prompt = [(7 * i + len(rid)) % 50 + 1 for i in range(prompt_len)]
    return GenerateRequest(rid, prompt, new, SamplingParams(seed=1), ignore_eos=True)


def _check_tables(sched: Scheduler, max_batched: int) -> None:
    """Every held id counted once per table holding it (shared ones are cached prefix
    blocks); windowed tables hold nothing a later query could not read, and no more than
    the peak."""
    held: Counter[int] = Counter()
    bound = peak_blocks((WINDOW,), 10**6, BS, max_batched)
    for seq in sched.running:
        tables = [seq.block_table, *seq.window_tables]
        assert len({len(t) for t in tables}) == 1, "every group's table covers the same blocks"
        held.update(b for t in tables for b in t if b >= 0)
        first_live = window_start(WINDOW, seq.num_computed) // BS
        for table in seq.window_tables:
            assert all(b == -1 for b in table[:first_live]), "a dead block is still held"
            assert sum(b >= 0 for b in table) <= bound
    for block, n in held.items():
        assert sched.blocks.ref_count(block) == n, f"block {block}: held {n} times"
        assert n == 1 or sched.blocks.cache.is_cached(block), "an uncached block shared"
    assert sched.blocks.num_free == sched.blocks.num_blocks - len(held)


def _run(sched: Scheduler, requests: list[GenerateRequest], max_batched: int) -> dict[str, int]:
    for r in requests:
        sched.add(r)
    produced: dict[str, int] = Counter()
    while sched.has_work():
        step = sched.schedule()
        _check_tables(sched, max_batched)
        tokens = [3 for c in step.chunks if c.sample]
        for update in sched.update(step, tokens):
            produced[update.sequence.request_id] += 1
    return produced


def test_long_sequence_holds_a_window_of_sliding_blocks() -> None:
    sched = _scheduler(num_blocks=200)
    produced = _run(sched, [_request("long", 50, 60)], max_batched=16)
    assert produced == {"long": 60}
    assert sched.blocks.num_free == 200


def test_windowed_blocks_return_to_the_pool_for_others() -> None:
    """A pool too small for two full tables per group and sequence still serves them all."""
    seq_len = 50 + 40
    one_full = 3 * -(-seq_len // BS)  # 69 ids if nothing were ever released
    num_blocks = peak_blocks(WINDOWS, seq_len, BS, 16) + 4
    assert num_blocks < one_full
    sched = _scheduler(num_blocks)
    produced = _run(sched, [_request(f"r{i}", 50, 40) for i in range(3)], max_batched=16)
    assert produced == {f"r{i}": 40 for i in range(3)}
    assert sched.stats.num_preemptions > 0
    # the three prompts are equal: the later ones hit every group's cached blocks
    assert sched.stats.prefix_cache_hit_tokens > 0
    assert sched.blocks.num_free == num_blocks


def test_preempted_sequence_resumes_with_fresh_tables() -> None:
    sched = _scheduler(num_blocks=peak_blocks(WINDOWS, 60, BS, 16))
    for r in (_request("a", 30, 30), _request("b", 30, 30)):
        sched.add(r)
    seen_preempt = False
    while sched.has_work():
        step = sched.schedule()
        _check_tables(sched, 16)
        seen_preempt |= bool(step.freed_seq_ids)
        for chunk in step.chunks:
            widths = {len(chunk.new_block_ids), *(len(w) for w in chunk.window_block_ids)}
            assert len(widths) == 1 and len(chunk.window_block_ids) == 2
        sched.update(step, [5 for c in step.chunks if c.sample])
    assert seen_preempt


def test_pool_check_counts_every_group() -> None:
    sched = _scheduler(num_blocks=peak_blocks(WINDOWS, 100, BS, 16))
    sched.add(_request("fits", 60, 40))
    with pytest.raises(ValueError, match="more than the whole cache"):
        sched.add(_request("too-long", 60, 60))
