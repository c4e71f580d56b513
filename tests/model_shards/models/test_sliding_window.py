"""Gemma 2's sliding window served for real: a prompt several windows long, prefilled in
chunks that straddle windows, then decoded, matches ``transformers``, while the blocks a
sequence holds in each sliding KV group stay bounded by the window (released, not masked)."""

from __future__ import annotations

from pathlib import Path

import pytest

from model_shards.config.kv_layout import KVLayout, peak_blocks
from model_shards.config.model import ModelConfig
from model_shards.config.replica import ReplicaConfig
from model_shards.engine.coordinator import Coordinator
from model_shards.messages import GenerateRequest, SamplingParams
from model_shards.parallel.comm import Comm
from model_shards.parallel.state import single_process_state
from model_shards.worker.decoder_worker import Worker
from tests.checkpoints import hf_greedy
from tests.families import gemma2

PROMPT = [(11 * i) % 400 + 5 for i in range(37)]  # six windows of gemma2.WINDOW tokens
NEW_TOKENS = 20
BLOCK = 4
CHUNK = 16  # prompt chunks of 16 tokens: each starts inside an earlier window


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return gemma2.build(tmp_path_factory.mktemp("gemma2-window"))


def _coordinator(checkpoint: Path) -> Coordinator:
    cfg = ModelConfig.from_dir(checkpoint)
    assert KVLayout.for_model(cfg).windows == (None, gemma2.WINDOW)
    replica = ReplicaConfig(
        str(checkpoint),
        dtype="float32",
        max_num_seqs=4,
        max_num_batched_tokens=CHUNK,
        block_size=BLOCK,
    )
    worker = Worker.build(replica, cfg, Comm(single_process_state()), 128)
    return Coordinator(worker, max_num_seqs=4, max_num_batched_tokens=CHUNK, max_model_len=128)


def _greedy(coord: Coordinator, rid: str, prompt: list[int]) -> list[int]:
    coord.add_request(
        GenerateRequest(rid, prompt, NEW_TOKENS, SamplingParams(0.0), ignore_eos=True)
    )
    tokens: list[int] = []
    while coord.has_work():
        for update in coord.step():
            tokens += update.output.new_token_ids
    coord.step()
    return tokens


@pytest.mark.timeout(120)
def test_long_prompt_matches_transformers_with_bounded_window_blocks(checkpoint: Path) -> None:
    coord = _coordinator(checkpoint)
    params = SamplingParams(0.0)
    coord.add_request(GenerateRequest("long", PROMPT, NEW_TOKENS, params, ignore_eos=True))
    bound = peak_blocks((gemma2.WINDOW,), 10**6, BLOCK, CHUNK)
    tokens: list[int] = []
    most_held = 0
    while coord.has_work():
        for seq in coord.scheduler.running:
            window_table = seq.window_tables[0]
            held = sum(b >= 0 for b in window_table)
            assert held <= bound, f"{held} sliding blocks held, window allows {bound}"
            most_held = max(most_held, held)
            assert len(seq.block_table) == len(window_table)
        for update in coord.step():
            tokens += update.output.new_token_ids
    coord.step()
    assert tokens == hf_greedy(checkpoint, PROMPT, NEW_TOKENS)
    total = -(-(len(PROMPT) + NEW_TOKENS) // BLOCK)
    assert 0 < most_held < total, "the sliding table was meant to release blocks"
    assert coord.stats.num_free_blocks == coord.stats.num_blocks
    coord.shutdown()


@pytest.mark.timeout(120)
def test_prefix_hit_restores_every_groups_window(checkpoint: Path) -> None:
    """A second prompt sharing the first's 32-token prefix starts from the cache (the global
    group's blocks and the sliding group's last window) and still matches transformers."""
    coord = _coordinator(checkpoint)
    first = _greedy(coord, "a", PROMPT)
    second_prompt = [*PROMPT[:32], 9, 8, 7]
    second = _greedy(coord, "b", second_prompt)
    assert coord.stats.prefix_cache_hit_tokens >= 28  # 7 of the 8 shared blocks
    assert first == hf_greedy(checkpoint, PROMPT, NEW_TOKENS)
    assert second == hf_greedy(checkpoint, second_prompt, NEW_TOKENS)
    coord.shutdown()
