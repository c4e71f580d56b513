"""GGUF checkpoints of every architecture served (``tests/model_shards/gguf/tiny.py``: float,
legacy and K-quant tensors) against transformers reading the same file, which dequantizes it.
One spawned world per layout: all six at tp=1; Llama and Qwen2 at tp=2; Llama at pp=2, served
from split shards (``-0000i-of-0000N.gguf``, named by its first shard) while the reference
reads the one-file copy of the same tensors. Each model is served twice:

* on the reference backend (the blocks dequantized inside each product, float32): prompt
  logits within 1e-4 relative and 24 greedy tokens identical — the file is read exactly;
* on the CPU kernels, which round each activation block to int8 before the integer dot
  products (as llama.cpp's CPU backend does: Q8_0 for the 32-value types, Q8_K for the
  K-quants). One rounding moves an activation by at most half a step, ``max|x_block| / 254``,
  so each product is off by up to ~0.4% of its block's ``|x|·|w|`` mass, compounded over the
  layers of these random models (whose logits are small and flat): the logits must agree
  within :data:`KERNEL_RTOL` of their largest magnitude and the first greedy token be the same.
"""

from __future__ import annotations

import json
import os
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
KERNEL_RTOL = 0.06
"""Logits of the CPU kernels against the dequantized reference: max |diff| / max |logit|."""
BACKENDS = {"reference": "reference", "kernels": "cpu"}  # SHARDSERVE_BACKEND per pass


def _gguf_rank(peers: Comm, paths: dict[str, str], out_dir: str) -> None:
    for name, path in paths.items():
        cfg = ModelConfig.from_dir(path)
        replica = ReplicaConfig(path, dtype="float32", max_num_seqs=8, block_size=4)
        for run, backend in BACKENDS.items():
            os.environ["SHARDSERVE_BACKEND"] = backend
            worker = Worker.build(replica, cfg, peers, MAX_LEN)
            assert worker.ops.name == backend, f"{run}: the {worker.ops.name} backend serves"
            serve_and_record(worker, f"{name}-{run}", out_dir)


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
        for backend in BACKENDS:
            run = f"{name}-{backend}"
            result = json.loads((tmp_path / f"{run}.json").read_text())
            ours = load_rows(tmp_path / f"{run}-logits.safetensors", result["seqs"])
            for i in range(len(PROMPTS)):
                ref_logits, ref_tokens = references[name][i]
                rel = ((ours[i] - ref_logits).abs().max() / ref_logits.abs().max()).item()
                tokens = result["tokens"][str(i)]
                if backend == "reference":
                    assert rel < 1e-4, f"{run} prompt {i}: logits relative error {rel:.2e}"
                    assert tokens == ref_tokens, f"{run} prompt {i}"
                else:
                    assert rel < KERNEL_RTOL, f"{run} prompt {i}: logits relative error {rel:.2e}"
                    assert tokens[0] == ref_tokens[0], f"{run} prompt {i}"
