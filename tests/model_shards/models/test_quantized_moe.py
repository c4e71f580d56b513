"""MoE experts of quantized checkpoints: a tiny Qwen2-MoE (sizes multiples of 32: every
matrix quantizes in groups) in AWQ, GPTQ with act-order, compressed-tensors W4A16 and
compressed-tensors FP8, served at tp=1, tp=2 (every expert sliced) and tp=2 with expert
parallelism (one spawned world per tp), by the reference and the cpu backends, against
transformers on the dense values the checkpoint holds (``tests/model_shards/quant_checkpoints.py``):
logits to float rounding, 24 greedy tokens equal.

* reference backend: attention, the dense layer's MLP and the shared expert stay quantized
  (``Int4GroupWeight`` / ``Fp8Weight``; FP8 is W8A8: the reference rounds those linears'
  inputs as at that tp); the routed experts are dequantized at load into the stacked
  parameters (its experts op takes dense matrices; ``layers/expert_quant.py``).
* cpu backend: 4-bit groups of 32 (AWQ, W4A16) become Q4_1 / Q4_0 blocks, the routed experts
  too (``FusedExperts.quantized``): the reference model takes the blocks' values and rounds
  every such product's input to the kernels' int8 blocks, the experts' included (their loop
  rewritten here with the rounding: transformers' experts are no ``nn.Linear``). Act-order
  and FP8 experts are dequantized at load (FP8 attention: dense W8A16).
"""

from __future__ import annotations

import json
import os
import types
from pathlib import Path

import pytest
import torch
import transformers

from model_shards.config.model import ModelConfig
from model_shards.config.replica import ReplicaConfig
from model_shards.layers.moe import FusedExperts
from model_shards.parallel.comm import Comm
from model_shards.quant.fp8 import quantize_activations
from model_shards.worker.decoder_worker import Worker
from tests.checkpoints import load_hf_model
from tests.families import qwen2_moe
from tests.logits import load_rows
from tests.model_shards.gguf.tiny import greedy_and_logits
from tests.model_shards.models.parity_harness import (
    MAX_LEN,
    NEW_TOKENS,
    PROMPTS,
    serve_and_record,
)
from tests.model_shards.models.test_quantized_checkpoints import (
    BACKENDS,
    ROUNDED_RTOL,
    _round_inputs,
    held_forms,
    int8_blocks,
)
from tests.model_shards.quant_checkpoints import write_quantized
from tests.world import run_world

# per format and backend: the forms its linears hold, whether the experts stay quantized, and
# how the reference rounds the quantized products' inputs
EXPECTED = {
    ("awq", "reference"): ({"Int4GroupWeight", "dense"}, False, "none"),
    ("awq", "kernels"): ({"Q4_1", "dense"}, True, "int8"),
    ("gptq-actorder", "reference"): ({"Int4GroupWeight", "dense"}, False, "none"),
    ("gptq-actorder", "kernels"): ({"Int4GroupWeight", "dense"}, False, "none"),
    ("ct-w4a16", "reference"): ({"Int4GroupWeight", "dense"}, False, "none"),
    ("ct-w4a16", "kernels"): ({"Q4_0", "dense"}, True, "int8"),
    ("ct-fp8-dynamic", "reference"): ({"Fp8Weight", "dense"}, False, "fp8"),
    ("ct-fp8-dynamic", "kernels"): ({"dense"}, False, "none"),
}  # "dense": the routers (and FP8 dequantized on CPU)
FORMATS = sorted({name for name, _ in EXPECTED})
LAYOUTS = {1: ("tp1",), 2: ("tp2", "ep2")}
SIZES = {"hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 64}
SIZES |= {"shared_expert_intermediate_size": 64}


def _rank(peers: Comm, paths: dict[str, str], out_dir: str) -> None:
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
            for run, backend in BACKENDS.items():
                os.environ["SHARDSERVE_BACKEND"] = backend
                worker = Worker.build(replica, cfg, peers, MAX_LEN)
                forms, quantized, _ = EXPECTED[(name, run)]
                assert held_forms(worker) == forms, f"{name} {layout} {run}: {held_forms(worker)}"
                experts = [m for m in worker.model.modules() if isinstance(m, FusedExperts)]
                assert experts and all(e.quantized == quantized for e in experts), name
                serve_and_record(worker, f"{name}-{layout}-{run}", out_dir)


def _rounded_experts(
    self: torch.nn.Module, x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """transformers' ``Qwen2MoeExperts.forward`` with both products' inputs rounded to the
    cpu kernels' int8 blocks."""
    out = torch.zeros_like(x)
    for e in range(self.num_experts):
        pos, token = torch.where(top_k_index.t() == e)  # [n], [n]
        if token.numel() == 0:
            continue
        gate, up = torch.nn.functional.linear(
            int8_blocks(x[token], None), self.gate_up_proj[e]
        ).chunk(2, dim=-1)
        h = int8_blocks(self.act_fn(gate) * up, None)
        y = torch.nn.functional.linear(h, self.down_proj[e]) * top_k_weights[token, pos, None]
        out.index_add_(0, token, y.to(out.dtype))
    return out


Reference = list[tuple[torch.Tensor, list[int]]]
_REFERENCES: dict[tuple[Path, int, str], Reference] = {}


def _reference(ref: Path, tp: int, rounding: str) -> Reference:
    """transformers' prompt logits and greedy tokens on ``ref``, the quantized products'
    inputs rounded as ``rounding`` says (at ``tp``: FP8 scales per rank's columns); once."""
    key = (ref, tp if rounding == "fp8" else 1, rounding)
    if key not in _REFERENCES:
        _REFERENCES[key] = _compute_reference(ref, tp, rounding)
    return _REFERENCES[key]


def _compute_reference(ref: Path, tp: int, rounding: str) -> Reference:
    model: transformers.PreTrainedModel = load_hf_model(ref)
    if rounding == "fp8":
        _round_inputs(model, ref, tp, quantize_activations)
    elif rounding == "int8":
        _round_inputs(model, ref, tp, int8_blocks)
        for module in model.modules():
            if type(module).__name__ == "Qwen2MoeExperts":
                module.forward = types.MethodType(_rounded_experts, module)  # type: ignore[method-assign]
    return [greedy_and_logits(model, p, NEW_TOKENS) for p in PROMPTS]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path, Path]]:
    """Each format: the directory served, its dense values, its values as GGML blocks."""
    root = tmp_path_factory.mktemp("quantized-moe")
    dense = qwen2_moe.build(root / "dense", **SIZES)
    out = {}
    for name in FORMATS:
        ref, blocks = root / f"{name}-ref", root / f"{name}-blocks"
        write_quantized(dense, name, root / name, ref, blocks)
        out[name] = (root / name, ref, blocks)
    return out


@pytest.mark.timeout(400)
@pytest.mark.parametrize("tp", list(LAYOUTS), ids=[f"tp{t}" for t in LAYOUTS])
def test_quantized_moe_matches_transformers(
    tp: int, tmp_path: Path, checkpoints: dict[str, tuple[Path, Path, Path]]
) -> None:
    paths = {name: str(served) for name, (served, _, _) in checkpoints.items()}
    run_world(_rank, tp, 1, paths, str(tmp_path), timeout=360)
    for (name, backend), (_, _, rounding) in EXPECTED.items():
        _, ref, blocks = checkpoints[name]
        expected = _reference(blocks if rounding == "int8" else ref, tp, rounding)
        bound = 1e-4 if rounding == "none" else ROUNDED_RTOL
        for layout in LAYOUTS[tp]:
            run = f"{name}-{layout}-{backend}"
            result = json.loads((tmp_path / f"{run}.json").read_text())
            ours = load_rows(tmp_path / f"{run}-logits.safetensors", result["seqs"])
            for i, (ref_logits, ref_tokens) in enumerate(expected):
                rel = ((ours[i] - ref_logits).abs().max() / ref_logits.abs().max()).item()
                assert rel < bound, f"{run} prompt {i}: logits relative error {rel:.2e}"
                assert result["tokens"][str(i)] == ref_tokens, f"{run} prompt {i}"
