"""GGUF checkpoints of every architecture served (``tests/model_shards/gguf/tiny.py``: float,
legacy and K-quant tensors) against transformers reading the same file: prompt logits
(float32, 1e-4 relative) and 24 greedy tokens identical. One spawned world per layout: all
six at tp=1; Llama and Qwen2 at tp=2; Llama at pp=2, served from split shards
(``-0000i-of-0000N.gguf``, named by its first shard) while the reference reads the one-file
copy of the same tensors.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from model_shards.config.model import ModelConfig
from model_shards.config.replica import ReplicaConfig
from model_shards.parallel.comm import Comm
from model_shards.worker.decoder_worker import Worker
from tests.logits import load_rows
from tests.model_shards.gguf.tiny import SPECS, build, greedy_and_logits, hf_reference
from tests.model_shards.models.parity_harness import (
    MAX_LEN,
    NEW_TOKENS,
    PROMPTS,
    serve_and_record,
)
from tests.world import run_world

LAYOUTS = {(1, 1): list(SPECS), (2, 1): ["llama", "qwen2"], (1, 2): ["llama-split"]}


def _gguf_rank(peers: Comm, paths: dict[str, str], out_dir: str) -> None:
    for name, path in paths.items():
        cfg = ModelConfig.from_dir(path)
        replica = ReplicaConfig(path, dtype="float32", max_num_seqs=8, block_size=4)
        serve_and_record(Worker.build(replica, cfg, peers, MAX_LEN), name, out_dir)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gguf")
    paths = {arch: build(arch, root / arch) for arch in SPECS}
    build("llama", root / "llama-split", split_max_tensors=8)
    shards = sorted((root / "llama-split").glob("*.gguf"))
    assert len(shards) > 2 and shards[0].name.endswith("-00001-of-00003.gguf"), shards
    paths["llama-split"] = shards[0]
    return paths


@pytest.fixture(scope="module")
def references(checkpoints: dict[str, Path]) -> dict[str, list[tuple[torch.Tensor, list[int]]]]:
    out = {}
    for arch in SPECS:
        model = hf_reference(checkpoints[arch], arch)
        out[arch] = [greedy_and_logits(model, p, NEW_TOKENS) for p in PROMPTS]
    out["llama-split"] = out["llama"]
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("tp", "pp"), list(LAYOUTS), ids=[f"tp{t}-pp{p}" for t, p in LAYOUTS])
def test_gguf_matches_transformers(
    tp: int,
    pp: int,
    tmp_path: Path,
    checkpoints: dict[str, Path],
    references: dict[str, list[tuple[torch.Tensor, list[int]]]],
) -> None:
    paths = {name: str(checkpoints[name]) for name in LAYOUTS[(tp, pp)]}
    run_world(_gguf_rank, tp, pp, paths, str(tmp_path), timeout=240)
    for name in paths:
        result = json.loads((tmp_path / f"{name}.json").read_text())
        ours = load_rows(tmp_path / f"{name}-logits.safetensors", result["seqs"])
        for i in range(len(PROMPTS)):
            ref_logits, ref_tokens = references[name][i]
            rel = ((ours[i] - ref_logits).abs().max() / ref_logits.abs().max()).item()
            assert rel < 1e-4, f"{name} prompt {i}: logits relative error {rel:.2e}"
            assert result["tokens"][str(i)] == ref_tokens, f"{name} prompt {i}"
