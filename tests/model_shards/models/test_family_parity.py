"""Every decoder family of ``tests/families`` against ``transformers``, on every layout it
can take (tp=1, tp=2, pp=2, tp=2 x pp=2): prompt logits (float32, 1e-4 relative) and 24
greedy tokens identical. One spawned world per layout loads each family in turn; then a
single-process check per family: one seeded sampled request draws the same alone and
among 15 concurrent others, with prefix caching on and a KV pool small enough to preempt.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import pytest
import torch

from model_shards.config.kv_layout import KVLayout, peak_blocks
from model_shards.config.model import ModelConfig
from model_shards.config.replica import ReplicaConfig
from model_shards.engine.coordinator import Coordinator
from model_shards.messages import GenerateRequest, SamplingParams
from model_shards.parallel.comm import Comm
from model_shards.parallel.state import single_process_state
from model_shards.worker.decoder_worker import Worker
from tests.checkpoints import hf_greedy, hf_prompt_logits
from tests.families import LAYOUTS, families, layouts_of
from tests.logits import load_rows
from tests.model_shards.models.parity_harness import (
    MAX_LEN,
    NEW_TOKENS,
    PROMPTS,
    serve_and_record,
)
from tests.world import run_world

FAMILIES = families()


def _family_rank(peers: Comm, dirs: dict[str, str], out_dir: str) -> None:
    for name, model_dir in dirs.items():
        cfg = ModelConfig.from_dir(model_dir)
        replica = ReplicaConfig(model_dir, dtype="float32", max_num_seqs=8, block_size=4)
        serve_and_record(Worker.build(replica, cfg, peers, MAX_LEN), name, out_dir)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {f.NAME: f.build(root / f.NAME) for f in FAMILIES}


@pytest.fixture(scope="module")
def references(checkpoints: dict[str, Path]) -> dict[str, dict[str, list]]:
    return {
        name: {
            "logits": [hf_prompt_logits(path, p)[-1] for p in PROMPTS],
            "tokens": [hf_greedy(path, p, NEW_TOKENS) for p in PROMPTS],
        }
        for name, path in checkpoints.items()
    }


def _in_layout(family: ModuleType, tp: int, pp: int) -> bool:
    return (tp, pp) in layouts_of(family)


@pytest.mark.timeout(400)
@pytest.mark.parametrize(("tp", "pp"), LAYOUTS, ids=[f"tp{t}-pp{p}" for t, p in LAYOUTS])
def test_families_match_transformers(
    tp: int,
    pp: int,
    tmp_path: Path,
    checkpoints: dict[str, Path],
    references: dict[str, dict[str, list]],
) -> None:
    names = [f.NAME for f in FAMILIES if _in_layout(f, tp, pp)]
    if not names:
        pytest.skip("no family takes this layout")
    dirs = {name: str(checkpoints[name]) for name in names}
    run_world(_family_rank, tp, pp, dirs, str(tmp_path), timeout=360)
    for name in names:
        result = json.loads((tmp_path / f"{name}.json").read_text())
        ours = load_rows(tmp_path / f"{name}-logits.safetensors", result["seqs"])
        for i in range(len(PROMPTS)):
            ref = references[name]["logits"][i]
            rel = ((ours[i] - ref).abs().max() / ref.abs().max()).item()
            assert rel < 1e-4, f"{name} prompt {i}: logits relative error {rel:.2e}"
            assert result["tokens"][str(i)] == references[name]["tokens"][i], f"{name} {i}"


def _seeded_runs(model_dir: Path, blocks: int) -> tuple[list[int], list[int], int]:
    """One seeded sampled request alone, then among 15 others (prompts sharing a prefix,
    a pool of ``blocks`` blocks of 4): its tokens both times and the preemptions seen."""
    cfg = ModelConfig.from_dir(model_dir)
    replica = ReplicaConfig(
        str(model_dir),
        dtype="float32",
        max_num_seqs=16,
        max_num_batched_tokens=64,
        block_size=4,
        kv_cache_memory=blocks * _block_bytes(cfg),
    )
    worker = Worker.build(replica, cfg, Comm(single_process_state()), MAX_LEN)
    coord = Coordinator(worker, max_num_seqs=16, max_num_batched_tokens=64, max_model_len=MAX_LEN)
    target = GenerateRequest("target", [7, 8, 9, 10, 11, 12], 16, SamplingParams(0.9, seed=5))
    alone = _generate_requests(coord, [target])["target"]
    others = [
        GenerateRequest(
            f"o{i}",
            [7, 8, 9, 10, 11] + [20 + i] * (i % 5 + 1),
            12,
            SamplingParams(1.0, top_p=0.9, seed=100 + i),
        )
        for i in range(15)
    ]
    crowd = _generate_requests(coord, [*others[:7], target, *others[7:]])["target"]
    return alone, crowd, coord.stats.num_preemptions


def _block_bytes(cfg: ModelConfig) -> int:
    """One block id's bytes: its KV groups share memory (one layer per slot)."""
    slots = KVLayout.for_model(cfg).slots_on(range(cfg.num_layers))
    return cfg.kv_block_bytes(1, slots, 4, torch.float32.itemsize)


def _generate_requests(coord: Coordinator, requests: list[GenerateRequest]) -> dict[str, list[int]]:
    for req in requests:
        coord.add_request(req)
    out: dict[str, list[int]] = {r.request_id: [] for r in requests}
    while coord.has_work():
        for update in coord.step():
            out[update.output.request_id] += update.output.new_token_ids
    coord.step()
    return out


@pytest.mark.timeout(200)
@pytest.mark.parametrize("family", FAMILIES, ids=[f.NAME for f in FAMILIES])
def test_seeded_request_same_alone_and_in_a_crowd(
    family: ModuleType, checkpoints: dict[str, Path]
) -> None:
    cfg = ModelConfig.from_dir(checkpoints[family.NAME])
    # a pool that holds one full-length sequence (its every KV group) and preempts
    blocks = max(40, peak_blocks(KVLayout.for_model(cfg).windows, MAX_LEN, 4, 64))
    alone, crowd, preemptions = _seeded_runs(checkpoints[family.NAME], blocks)
    assert alone == crowd
    assert len(alone) == 16
    assert preemptions > 0, "the pool was meant to be small enough to preempt"
