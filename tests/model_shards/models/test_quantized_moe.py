"""MoE experts of quantized checkpoints: a tiny Qwen2-MoE (sizes multiples of 32: every
matrix quantizes in groups) in AWQ, GPTQ with act-order, compressed-tensors W4A16 (asymmetric)
and compressed-tensors FP8, served by the reference backend at tp=1, tp=2 (every expert sliced)
and tp=2 with expert parallelism, against transformers on the dense values the checkpoint holds
(``tests/model_shards/quant_checkpoints.py``): logits to float rounding, 24 greedy tokens equal.

Attention, the dense layer's MLP and the shared expert stay quantized (``Int4GroupWeight`` /
``Fp8Weight``; FP8 is W8A8, so the reference rounds those linears' inputs as at that tp); the
routed experts are dequantized at load into the stacked dense parameters (``QuantSource.read``,
logged): the experts' op (``Backend.fused_moe``) takes dense matrices.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from model_shards.config.model import ModelConfig
from model_shards.config.replica import ReplicaConfig
from model_shards.layers.moe import FusedExperts
from model_shards.parallel.comm import Comm
from model_shards.worker.decoder_worker import Worker
from tests.families import qwen2_moe
from tests.logits import load_rows
from tests.model_shards.models.parity_harness import MAX_LEN, serve_and_record
from tests.model_shards.models.test_quantized_checkpoints import (
    ROUNDED_RTOL,
    References,
    held_forms,
)
from tests.model_shards.quant_checkpoints import SPECS, write_quantized
from tests.world import run_world

FORMATS = {"awq": "none", "gptq-actorder": "none", "ct-w4a16-asym": "none"}
FORMATS |= {"ct-fp8-dynamic": "fp8"}  # the rounding of the quantized linears' inputs
LAYOUTS = {1: ("tp1",), 2: ("tp2", "ep2")}
SIZES = {"hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 64}
SIZES |= {"shared_expert_intermediate_size": 64}


def _rank(peers: Comm, paths: dict[str, str], out_dir: str) -> None:
    os.environ["SHARDSERVE_BACKEND"] = "reference"
    for name, path in paths.items():
        cfg = ModelConfig.from_dir(path)
        for layout in LAYOUTS[peers.ps.tp_size]:
            replica = ReplicaConfig(
                path,
                dtype="float32",
                max_num_seqs=8,
                block_size=4,
                enable_expert_parallel=layout == "ep2",
            )
            worker = Worker.build(replica, cfg, peers, MAX_LEN)
            quantized = "Fp8Weight" if FORMATS[name] == "fp8" else "Int4GroupWeight"
            forms = held_forms(worker)
            assert forms == {quantized, "dense"}, f"{name} {layout}: {forms}"  # dense: routers
            experts = [m for m in worker.model.modules() if isinstance(m, FusedExperts)]
            assert experts and all(
                e.w13_weight.numel() > 0 and bool(torch.isfinite(e.w2_weight).all())
                for e in experts
            ), f"{name} {layout}: experts not dense"
            serve_and_record(worker, f"{name}-{layout}", out_dir)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, dict]]:
    root = tmp_path_factory.mktemp("quantized-moe")
    dense = qwen2_moe.build(root / "dense", **SIZES)
    out = {}
    for name in FORMATS:
        ref = root / f"{name}-ref"
        write_quantized(dense, name, root / name, ref, root / f"{name}-blocks")
        out[name] = (root / name, {(tp, FORMATS[name]): ref for tp in LAYOUTS})
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("tp", list(LAYOUTS), ids=[f"tp{t}" for t in LAYOUTS])
def test_quantized_moe_matches_transformers(
    tp: int, tmp_path: Path, checkpoints: dict[str, tuple[Path, dict]]
) -> None:
    assert all(SPECS[name].group_size <= 32 for name in FORMATS)
    references = References(checkpoints)
    paths = {name: str(served) for name, (served, _) in checkpoints.items()}
    run_world(_rank, tp, 1, paths, str(tmp_path), timeout=240)
    for name, rounding in FORMATS.items():
        bound = ROUNDED_RTOL if rounding == "fp8" else 1e-4
        for layout in LAYOUTS[tp]:
            run = f"{name}-{layout}"
            result = json.loads((tmp_path / f"{run}.json").read_text())
            ours = load_rows(tmp_path / f"{run}-logits.safetensors", result["seqs"])
            for i, (ref_logits, ref_tokens) in enumerate(references(name, tp, rounding)):
                rel = ((ours[i] - ref_logits).abs().max() / ref_logits.abs().max()).item()
                assert rel < bound, f"{run} prompt {i}: logits relative error {rel:.2e}"
                assert result["tokens"][str(i)] == ref_tokens, f"{run} prompt {i}"
