"""The packaged SmolLM2 GGUF's weights as a dense Hugging Face directory (a subprocess).

Run as ``python -m benchmarks gpu smollm2_dense OUT [--gguf FILE] [--dtype bfloat16]``.
Every tensor is read through the server's own GGUF reader
(:class:`~model_shards.worker.gguf_checkpoint.GGUFCheckpoint`: HF names, llama's q/k rows
un-permuted, blocks dequantized by ``gguf.quants``, bit-exact with llama.cpp) and stored in
``--dtype`` as one ``model.safetensors``; ``config.json`` is the GGUF metadata's HF config
(:func:`~model_shards.gguf.architectures.load_hf_config`) and ``tokenizer.json`` /
``tokenizer_config.json`` the server's GGUF tokenizer. No ``transformers`` (nor
``accelerate``) is needed, so it runs on the offline GPU host.

The gpu-check's perplexity phase serves this directory as the bfloat16 baseline and with
``--quantization fp8``. A ``smollm2_dense.json`` marker (the GGUF's size, the dtype) makes a
rerun return at once. Prints one JSON line: ``{"cached", "seconds", "dir"}``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from benchmarks.harness.whole_dir import write_whole
from model_shards.gguf.architectures import load_hf_config
from model_shards.gguf.tokenizer import tokenizer_from_gguf
from model_shards.launch.packaged_model import packaged_gguf
from model_shards.worker.gguf_checkpoint import GGUFCheckpoint

VERSION = "v1"
MARKER = "smollm2_dense.json"


def marker(gguf: Path, dtype: str) -> dict[str, Any]:
    return {"version": VERSION, "gguf": gguf.name, "bytes": gguf.stat().st_size, "dtype": dtype}


def write_dense(gguf: Path, out: Path, dtype: str) -> int:
    """``gguf``'s weights in ``dtype`` with config and tokenizer at ``out``; tensor bytes."""
    with GGUFCheckpoint(gguf) as checkpoint:
        tensors = {
            name: checkpoint.source(name).read().to(getattr(torch, dtype)).contiguous()
            for name in checkpoint.names()
        }
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = {**load_hf_config(gguf), "torch_dtype": dtype}
    (out / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    tokenizer, tokenizer_config = tokenizer_from_gguf(gguf)
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=1) + "\n")
    return sum(t.numel() * t.element_size() for t in tensors.values())


def ensure(gguf: Path, target: Path, dtype: str) -> dict[str, Any]:
    """Write ``target`` unless a matching one is there; what was done."""
    try:
        if json.loads((target / MARKER).read_text()) == marker(gguf, dtype):
            return {"cached": True, "seconds": 0.0, "dir": str(target)}
    except (OSError, ValueError):
        pass
    start = time.perf_counter()

    def write(tmp: Path) -> int:
        written = write_dense(gguf, tmp, dtype)
        (tmp / MARKER).write_text(json.dumps(marker(gguf, dtype)) + "\n")
        return written

    written = write_whole(target, write)
    seconds = time.perf_counter() - start
    return {"cached": False, "seconds": seconds, "bytes": written, "dir": str(target)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--gguf", type=Path, default=None, help="default: the packaged SmolLM2")
    p.add_argument("--dtype", default="bfloat16")
    args = p.parse_args(argv)
    done = ensure(args.gguf or packaged_gguf(), args.out, args.dtype)
    print(json.dumps(done), flush=True)
    return 0
