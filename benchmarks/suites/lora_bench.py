"""Multi-LoRA's cost: output tok/s of 32 concurrent requests spread over four LoRA adapters
(eight each, mixed in every step) against 32 on the base model, one server, bench model,
float32. Target: mixed adapters ≥ 80% of the base model.

The four adapters are random (rank 16, all seven Llama modules, written in the PEFT format
into the cache) and served with ``--enable-lora --max-loras 4``, so none is ever swapped. Both
kinds are streaming completions of the same shape (32-token prompts, 64 greedy output tokens,
EOS ignored) on fresh prompts; one untimed point runs first, then the kinds alternate, the
order reversed every other round; the table shows each kind's median round.

``python -m benchmarks suites lora_bench --rounds 1`` runs these rows alone, to ``--out``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer

from benchmarks.harness.ab_rows import Point, alternate, pair_table, run_alone
from benchmarks.harness.bench import (
    OUTPUT_LEN,
    POINT_CAP_S,
    PROMPT_LEN,
    REQUEST_TIMEOUT_S,
    Bench,
    num_requests,
    start_ours,
)
from benchmarks.harness.paths import CACHE
from benchmarks.harness.prompts import exact_prompts, write_dataset
from deploy.loadtest import run_benchmark
from deploy.loadtest_lib.config import LoadPoint, RunConfig
from model_shards.config.lora import TARGET_MODULES, module_shape
from model_shards.config.model import ModelConfig

ADAPTERS, RANK, DEFAULT_ROUNDS = 4, 16, 2
LAYOUTS = {"base": "base model (same server)", "mixed": "4 LoRA adapters mixed"}
KINDS = ("base", "mixed")


def write_adapters(model_dir: Path, out: Path) -> list[tuple[str, Path]]:
    """:data:`ADAPTERS` random PEFT adapters of the model at ``model_dir`` (kept in ``out``)."""
    cfg = ModelConfig.from_dir(model_dir)
    adapters = []
    for i in range(ADAPTERS):
        path = out / f"lora-{i}"
        if not (path / "adapter_model.safetensors").is_file():
            gen = torch.Generator().manual_seed(i)
            tensors = {}
            for layer in range(cfg.num_layers):
                for module in TARGET_MODULES:
                    n_in, n_out = module_shape(cfg, module)
                    part = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
                    key = f"base_model.model.model.layers.{layer}.{part}.{module}"
                    a, b = torch.randn(RANK, n_in, generator=gen), torch.randn(n_out, RANK)
                    tensors[f"{key}.lora_A.weight"] = a * 0.02
                    tensors[f"{key}.lora_B.weight"] = b * 0.02
            path.mkdir(parents=True, exist_ok=True)
            save_file(tensors, str(path / "adapter_model.safetensors"))
            config = {"peft_type": "LORA", "r": RANK, "lora_alpha": 2 * RANK}
            config["target_modules"] = list(TARGET_MODULES)
            (path / "adapter_config.json").write_text(json.dumps(config))
        adapters.append((f"lora-{i}", path))
    return adapters


def _configs(url: str, dataset: str, c: int, kind: str) -> list[RunConfig]:
    """One closed loop at ``c`` on the base model, or one per adapter sharing ``c``."""
    models = [""] if kind == "base" else [f"lora-{i}" for i in range(ADAPTERS)]
    share, n = c // len(models), num_requests(c) // len(models)
    return [
        RunConfig(
            base_url=url, model=model, endpoint="completions", points=(LoadPoint(share, None),),
            output_len=OUTPUT_LEN, dataset=dataset, num_requests=n, duration_s=POINT_CAP_S,
            timeout_s=REQUEST_TIMEOUT_S, ignore_eos=True, extra_body={"temperature": 0},
        )
        for model in models
    ]  # fmt: skip


async def _run_all(configs: list[RunConfig]) -> list[Any]:
    return list(await asyncio.gather(*(run_benchmark(c) for c in configs)))


def _point(bench: Bench, url: str, dataset: str, c: int, kind: str, record: bool = True) -> None:
    """One point of ``kind`` (recorded unless ``record`` is false: a warm-up)."""
    load_before = os.getloadavg()[0]
    points = [run.points[0] for run in asyncio.run(_run_all(_configs(url, dataset, c, kind)))]
    duration = max(p.metrics.duration_s for p in points)
    requests = [r for p in points for r in p.requests]
    streamed = sum(r.output_tokens if r.ok else r.chunks for r in requests)
    failed = sorted({str(r.error) for r in requests if not r.ok})
    metrics = {"duration_s": duration, "streamed_throughput": streamed / duration}
    metrics |= {"errors": {"failed": len(failed)} if failed else {}, "error_samples": failed[:3]}
    if record:
        tok_s = metrics["streamed_throughput"]
        bench.add("shardserve", "float32", c, LAYOUTS[kind], tok_s, metrics, load_before)


def run_lora(bench: Bench, c: int, rounds: int = DEFAULT_ROUNDS) -> None:
    """The rows of the module docstring at concurrency ``c`` (the server stopped on exit)."""
    tokenizer = Tokenizer.from_file(str(bench.model / "tokenizer.json"))
    n = num_requests(c)
    prompts = exact_prompts(tokenizer, n * (2 * rounds + 1), PROMPT_LEN, seed="lora-v1")
    datasets = [
        str(write_dataset(tokenizer, prompts[i * n : (i + 1) * n], OUTPUT_LEN, path))
        for i, path in enumerate(CACHE / f"data/lora-c{c}-{i}.jsonl" for i in range(2 * rounds + 1))
    ]
    modules = [f"{name}={path}" for name, path in write_adapters(bench.model, CACHE / "lora")]
    flags = ["--enable-lora", "--max-loras", str(ADAPTERS), "--max-lora-rank", str(RANK)]
    with contextlib.ExitStack() as stack:
        _, url, _ = start_ours(stack, "float32", [*flags, "--lora-modules", *modules], "lora")
        point: Point = lambda d, kind, rec: _point(bench, url, d, c, kind, rec)  # noqa: E731
        alternate(point, datasets, KINDS, rounds, warm="mixed")


def lora_table(result: dict[str, Any]) -> str:
    """Mixed adapters against the base model's tok/s, and their ratio (target ≥ 0.80×)."""
    layouts = (LAYOUTS["base"], LAYOUTS["mixed"])
    return pair_table(result, layouts, ("base model", "4 LoRA adapters mixed"), "vs base")


def main(argv: list[str] | None = None) -> int:
    """These rows alone (``--concurrency``, ``--rounds``), to ``--out``."""
    description = "the multi-LoRA rows of make bench"
    return run_alone(
        description, "/tmp/lora-bench.json", DEFAULT_ROUNDS, run_lora, lora_table, argv
    )
