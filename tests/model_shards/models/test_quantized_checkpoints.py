"""Quantized checkpoints of the tiny Llama (AWQ, GPTQ with and without act-order,
compressed-tensors W4A16 and FP8, FBGEMM FP8: ``tests/model_shards/quant_checkpoints.py``), and
the dense one with ``--quantization fp8``, served at tp=1 and tp=2 (one spawned world each)
against transformers running the dense values they hold (transformers cannot run these formats
on CPU without their GPU packages), each run to float rounding (logits within 1e-4 relative,
24 greedy tokens equal) once the reference model rounds what ours rounds:

* reference backend: 4-bit weights unpacked, float32 products: nothing rounded. FP8 is W8A8:
  the reference model rounds each quantized linear's input to FP8 too (``quant.fp8.
  quantize_activations``: per token over each rank's columns, as a row-parallel layer sees
  them at tp=2, or by the static ``input_scale``). ``--quantization fp8`` scales each rank's
  slice of a row-parallel weight on its own, so its dense values depend on tp;
* cpu backend: 4-bit groups of 32 become Q4_0 / Q4_1 blocks (``quant/int4_ggml.py``), whose
  kernels round activations to int8 per 32 values: the reference model does the same
  (:func:`int8_blocks`) with the weights as the blocks hold them (Q4_1's offset rounded to
  float16: left out, it alone moves these random models' logits by ~4%). Act-order weights stay
  4-bit (dequantized in each product); FP8 weights become dense (W8A16).

Where activations are rounded, a float-rounding difference could move one across a rounding
boundary: :data:`ROUNDED_RTOL` leaves room for a few (measured: none, ~1e-6 everywhere).
A compressed-tensors FP8 Qwen2-MoE checks the experts, dequantized at load (tp=1, in-process).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from model_shards.backends import ReferenceBackend
from model_shards.config.model import ModelConfig
from model_shards.config.replica import ReplicaConfig
from model_shards.engine.coordinator import Coordinator
from model_shards.layers.checkpoint_quant import ckpt_of
from model_shards.layers.linear import LinearBase
from model_shards.layers.loading import quant_of
from model_shards.layers.vocab import VocabParallelEmbedding
from model_shards.parallel.comm import Comm
from model_shards.parallel.state import single_process_state
from model_shards.quant.formats import GGMLType
from model_shards.quant.fp8 import quantize_activations
from model_shards.worker.decoder_worker import Worker
from tests.checkpoints import build_tiny_llama, load_hf_model
from tests.families import qwen2_moe
from tests.logits import load_rows, prompt_logits, record_logits
from tests.model_shards.gguf.tiny import greedy_and_logits
from tests.model_shards.models.parity_harness import (
    MAX_LEN,
    NEW_TOKENS,
    PROMPTS,
    generate_greedy,
    serve_and_record,
)
from tests.model_shards.quant_checkpoints import LINEARS, SPECS, write_quantized
from tests.world import run_world

ROUNDED_RTOL = 2e-3
BACKENDS = {"reference": "reference", "kernels": "cpu"}


def held_forms(worker: Worker) -> set[str]:
    """What the decoder layers' linears hold: ``int4``/``fp8`` parts, GGML types, ``dense``."""
    forms: set[str] = set()
    for module in worker.model.modules():
        if not isinstance(module, LinearBase) or isinstance(module, VocabParallelEmbedding):
            continue
        ckpt, quant = ckpt_of(module.weight), quant_of(module.weight)
        if ckpt is not None:
            forms |= {type(p).__name__ for _, p in ckpt.parts}
        elif quant is not None:
            forms |= {GGMLType(s.tensor.qtype).name for s in quant.segments}
        else:
            forms.add("dense")
    return forms


EXPECTED_FORMS = {
    ("reference", "int4"): {"Int4GroupWeight"},
    ("reference", "fp8"): {"Fp8Weight"},
    ("kernels", "int4"): {"Q4_0"},
    ("kernels", "int4-asym"): {"Q4_1"},
    ("kernels", "int4-actorder"): {"Int4GroupWeight"},
    ("kernels", "fp8"): {"dense"},
}


AT_LOAD = "fp8-at-load"  # the dense checkpoint with --quantization fp8


def _kind(name: str, run: str) -> str:
    if name == AT_LOAD:
        return "fp8"
    spec = SPECS[name]
    if spec.layout in ("ct-fp8", "fbgemm"):
        return "fp8"
    if run == "reference":
        return "int4"
    return "int4-actorder" if spec.act_order else ("int4" if spec.symmetric else "int4-asym")


def _rank(peers: Comm, paths: dict[str, str], out_dir: str) -> None:
    for name, path in paths.items():
        cfg = ModelConfig.from_dir(path)
        quantization = "fp8" if name == AT_LOAD else None
        replica = ReplicaConfig(
            path, dtype="float32", max_num_seqs=8, block_size=4, quantization=quantization
        )
        for run, backend in BACKENDS.items():
            os.environ["SHARDSERVE_BACKEND"] = backend
            worker = Worker.build(replica, cfg, peers, MAX_LEN)
            forms = held_forms(worker)
            assert forms == EXPECTED_FORMS[(run, _kind(name, run))], f"{name} {run}: {forms}"
            vocab = [m for m in worker.model.modules() if isinstance(m, VocabParallelEmbedding)]
            assert len(vocab) == 2 and all(
                ckpt_of(m.weight) is None and quant_of(m.weight) is None for m in vocab
            ), f"{name} {run}: the embedding and LM head stay dense"
            serve_and_record(worker, f"{name}-{run}", out_dir)


ROW_PARALLEL = ("o_proj", "down_proj")  # split along K at tp > 1
Refs = dict[tuple[int, str], Path]
"""``(tp, rounding)`` → the dense values a layout is compared with, its quantized linears'
inputs rounded as ``rounding`` says (:func:`references`)."""


def _at_load_values(dense: Path, out: Path, tp: int) -> Path:
    """``--quantization fp8``'s values at ``tp`` as a dense copy: per-channel scales over each
    rank's columns (a row-parallel weight's K is split before it is quantized)."""
    shutil.copytree(dense, out)
    tensors = load_file(str(dense / "model.safetensors"))
    for name, w in tensors.items():
        if not (name.endswith(".weight") and any(f".{x}." in name for x in LINEARS)):
            continue
        parts = []
        for c in w.float().chunk(tp if any(r in name for r in ROW_PARALLEL) else 1, dim=1):
            scale = c.abs().amax(1, keepdim=True) / 448
            scale = torch.where(scale == 0, 1.0, scale)
            parts.append((c / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale)
        tensors[name] = torch.cat(parts, dim=1).to(w.dtype)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "input_scales.json").write_text("{}")
    return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Refs]]:
    """Each layout: the directory served, and the dense values to compare it with."""
    root = tmp_path_factory.mktemp("quantized")
    dense = build_tiny_llama(root / "dense", sharded=False)
    out: dict[str, tuple[Path, Refs]] = {}
    at_load = {tp: _at_load_values(dense, root / f"{AT_LOAD}-{tp}", tp) for tp in (1, 2)}
    out[AT_LOAD] = (dense, {(tp, r): at_load[tp] for tp in (1, 2) for r in ("none", "fp8")})
    for name in SPECS:
        ref, blocks = root / f"{name}-ref", root / f"{name}-blocks"
        write_quantized(dense, name, root / name, ref, blocks)
        rounded = "fp8" if _kind(name, "reference") == "fp8" else "int8"
        refs = {(tp, "none"): ref for tp in (1, 2)}
        refs |= {(tp, rounded): ref if rounded == "fp8" else blocks for tp in (1, 2)}
        out[name] = (root / name, refs)
    return out


def int8_blocks(x: torch.Tensor, _: torch.Tensor | None) -> torch.Tensor:
    """``x [T, K]`` rounded as the cpu kernels round activations for Q4_0 / Q4_1 weights
    (``kernels/quant_dot.h``, ``quantize_row``): per 32 values, ``d = max|x| / 127``,
    ``round_half_even(x / d) · d``."""
    blocks = x.float().reshape(-1, 32)
    d = blocks.abs().amax(dim=1, keepdim=True) / 127
    inverse = torch.where(d == 0, 0.0, 1 / d)
    return ((blocks * inverse).round().clamp(-127, 127) * d).reshape(x.shape)


Rounding = Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]


def _round_inputs(
    model: transformers.PreTrainedModel, ref: Path, tp: int, rounding: Rounding
) -> None:
    """Each quantized linear of ``model`` rounds its input first (``rounding(x, input_scale)``:
    W8A8's FP8, or the cpu kernels' int8 blocks) over each rank's columns at ``tp`` (a
    row-parallel layer's input is split ``tp`` ways; FP8's dynamic scale is per token there)."""
    scales = json.loads((ref / "input_scales.json").read_text())
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear) or name.rpartition(".")[2] not in LINEARS:
            continue  # the LM head, MoE routers: dense in the checkpoints
        s = scales.get(name)
        static = None if s is None else torch.tensor(s)
        split = tp if name.endswith(ROW_PARALLEL) else 1

        def hook(
            _: torch.nn.Module,
            args: tuple[torch.Tensor],
            st: torch.Tensor | None = static,
            split: int = split,
        ) -> tuple[torch.Tensor]:
            x = args[0].reshape(-1, args[0].shape[-1])  # [T, K]
            parts = [rounding(c, st) for c in x.chunk(split, dim=-1)]
            return (torch.cat(parts, dim=-1).view(args[0].shape),)

        module.register_forward_pre_hook(hook)


Reference = list[tuple[torch.Tensor, list[int]]]


class References:
    """``(layout, tp, rounding)`` → transformers' prompt logits and greedy tokens on the dense
    values, the activations of its quantized linears not rounded (``none``), rounded to FP8 as
    at that tp (``fp8``) or to the cpu kernels' int8 blocks (``int8``: blocks of 32 do not
    straddle a rank's columns, so the same at every tp). Computed when first asked, once per
    distinct weights (several layouts hold the same values)."""

    def __init__(self, checkpoints: dict[str, tuple[Path, Refs]]) -> None:
        self.checkpoints = checkpoints
        self.done: dict[tuple[str, int, str], Reference] = {}

    def __call__(self, name: str, tp: int, rounding: str) -> Reference:
        ref = self.checkpoints[name][1][(tp, rounding)]
        digest = hashlib.sha256((ref / "model.safetensors").read_bytes()).hexdigest()
        scales = (ref / "input_scales.json").read_text()
        key = (digest + scales, tp if rounding == "fp8" else 1, rounding)
        if key not in self.done:
            model = load_hf_model(ref)
            if rounding != "none":
                rounder = quantize_activations if rounding == "fp8" else int8_blocks
                _round_inputs(model, ref, key[1], rounder)
            self.done[key] = [greedy_and_logits(model, p, NEW_TOKENS) for p in PROMPTS]
        return self.done[key]


@pytest.fixture(scope="module")
def references(checkpoints: dict[str, tuple[Path, Refs]]) -> References:
    return References(checkpoints)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("tp", [1, 2], ids=["tp1", "tp2"])
def test_quantized_checkpoints_match_transformers(
    tp: int,
    tmp_path: Path,
    checkpoints: dict[str, tuple[Path, Refs]],
    references: References,
) -> None:
    paths = {name: str(served) for name, (served, _) in checkpoints.items()}
    run_world(_rank, tp, 1, paths, str(tmp_path), timeout=240)
    for name in paths:
        for backend in BACKENDS:
            run = f"{name}-{backend}"
            forms = EXPECTED_FORMS[(backend, _kind(name, backend))]
            rounding = {"Fp8Weight": "fp8", "Q4_0": "int8", "Q4_1": "int8"}.get(min(forms), "none")
            result = json.loads((tmp_path / f"{run}.json").read_text())
            ours = load_rows(tmp_path / f"{run}-logits.safetensors", result["seqs"])
            bound = ROUNDED_RTOL if rounding != "none" else 1e-4
            for i, (ref_logits, ref_tokens) in enumerate(references(name, tp, rounding)):
                rel = ((ours[i] - ref_logits).abs().max() / ref_logits.abs().max()).item()
                tokens = result["tokens"][str(i)]
                assert rel < bound, f"{run} prompt {i}: logits relative error {rel:.2e}"
                assert tokens == ref_tokens, f"{run} prompt {i}"


@pytest.mark.timeout(120)
def test_moe_experts_in_fp8_are_dequantized_at_load(tmp_path: Path) -> None:
    """A compressed-tensors FP8 Qwen2-MoE: attention and the shared expert W8A8 (their inputs
    rounded), the routed experts dequantized at load into the stacked dense parameters
    (transformers' fused experts module is no ``nn.Linear``: not rounded there either)."""
    dense = qwen2_moe.build(tmp_path / "dense")
    served, ref = tmp_path / "fp8", tmp_path / "fp8-ref"
    write_quantized(dense, "ct-fp8-dynamic", served, ref, tmp_path / "fp8-blocks")
    model = load_hf_model(ref)
    _round_inputs(model, ref, 1, quantize_activations)
    expected = [greedy_and_logits(model, p, NEW_TOKENS) for p in PROMPTS]
    replica = ReplicaConfig(str(served), dtype="float32", max_num_seqs=4, block_size=4)
    worker = Worker.build(
        replica, ModelConfig.from_dir(served), Comm(single_process_state()), MAX_LEN,
        ops=ReferenceBackend(),
    )  # fmt: skip
    assert held_forms(worker) == {"Fp8Weight", "dense"}  # the MoE routers' gates are dense
    recorder = record_logits(worker)
    coord = Coordinator(worker, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=MAX_LEN)
    logits = prompt_logits(coord, recorder, PROMPTS)
    tokens = generate_greedy(coord, PROMPTS)
    for i, (ref_logits, ref_tokens) in enumerate(expected):
        rel = ((logits[i] - ref_logits).abs().max() / ref_logits.abs().max()).item()
        assert rel < ROUNDED_RTOL, f"prompt {i}: logits relative error {rel:.2e}"
        assert tokens[str(i)] == ref_tokens, f"prompt {i}"
