"""The gpu-check's 8B-shaped checkpoint as compressed-tensors FP8 and as AWQ (a subprocess).

Run as ``python -m benchmarks gpu quant_checkpoints DENSE ROOT --formats fp8,awq --device
cuda --group-size 128 --shape llama3-8b --dtype bfloat16 --wait-s 240``. It waits (polling)
until ``DENSE`` is a complete :mod:`benchmarks.gpu.build_model` checkpoint of that shape,
then writes each format to ``ROOT/<DENSE name>-<format>`` (:func:`quant_dir`), shard by
shard: every shard's tensors
are read onto ``--device``, the decoder linears quantized there by the bench quantizer's
own functions (:mod:`benchmarks.harness.quantize_checkpoint`: round to nearest, FP8
per-channel scales, AWQ GEMM packing), the shard written back from the host. On the GPU
this takes seconds a format at 8B; the same code on CPU took ~7 s (FP8) and ~20 s (AWQ)
for the 135M bench model on two cores, ~66× fewer linear weights, hence the GPU.

Like the dense build, each output is written under a temporary name and renamed; a
``gpu_check_quant.json`` marker (format, group size, the dense marker) makes a rerun
return at once. Prints one JSON line per format: ``{"event": "quantized", "format",
"cached", "seconds", "bytes"}`` (``bytes``: tensor data stored).
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from benchmarks.gpu.build_model import INDEX, is_built
from benchmarks.gpu.build_model import MARKER as DENSE_MARKER
from benchmarks.gpu.shapes import SHAPES, LlamaShape
from benchmarks.harness.quantize_checkpoint import (
    FORMATS,
    LINEARS,
    awq_tensors,
    fp8_tensors,
    quantization_config,
)
from benchmarks.harness.whole_dir import write_whole

VERSION = "v1"  # bump when the bytes change
MARKER = "gpu_check_quant.json"
POLL_S = 1.0


def quant_dir(dense: Path, root: Path, fmt: str) -> Path:
    """Where ``fmt`` of ``dense`` goes: ``root/<dense name>-<fmt>``."""
    return root / f"{dense.name}-{fmt}"


def marker(dense: Path, fmt: str, group_size: int) -> dict[str, Any]:
    built = json.loads((dense / DENSE_MARKER).read_text())
    return {"version": VERSION, "format": fmt, "group_size": group_size, "dense": built}


def is_quantized(out: Path, dense: Path, fmt: str, group_size: int) -> bool:
    try:
        return bool(json.loads((out / MARKER).read_text()) == marker(dense, fmt, group_size))
    except (OSError, ValueError):
        return False


def shard_names(dense: Path) -> list[str]:
    """The dense checkpoint's safetensors files: the index's, else ``model.safetensors``."""
    index = dense / INDEX
    if not index.is_file():
        return ["model.safetensors"]
    return sorted(set(json.loads(index.read_text())["weight_map"].values()))


def quantize_tensors(
    tensors: dict[str, torch.Tensor], fmt: str, group_size: int
) -> dict[str, torch.Tensor]:
    """One shard's tensors with its decoder linears' ``weight`` in ``fmt``, on the host."""
    out: dict[str, torch.Tensor] = {}
    for name, w in tensors.items():
        prefix = name.removesuffix(".weight")
        if not name.endswith(".weight") or prefix.rpartition(".")[2] not in LINEARS:
            out[name] = w
        elif fmt == "fp8":
            out |= fp8_tensors(prefix, w)
        else:
            out |= awq_tensors(prefix, w, group_size)
    return {name: t.contiguous().cpu() for name, t in out.items()}


def write_sharded(dense: Path, out: Path, fmt: str, group_size: int, device: str) -> int:
    """``dense`` with its decoder linears in ``fmt`` at ``out`` (shards, index, config,
    tokenizer); returns the bytes of tensor data written."""
    if fmt not in FORMATS:
        raise ValueError(f"format {fmt!r}: choose one of {FORMATS}")
    out.mkdir(parents=True, exist_ok=True)
    weight_map: dict[str, str] = {}
    total = 0
    for shard in shard_names(dense):
        with safe_open(str(dense / shard), framework="pt", device="cpu") as f:
            tensors = {name: f.get_tensor(name).to(device) for name in f.keys()}  # noqa: SIM118
        stored = quantize_tensors(tensors, fmt, group_size)
        save_file(stored, str(out / shard), metadata={"format": "pt"})
        total += sum(t.numel() * t.element_size() for t in stored.values())
        weight_map.update(dict.fromkeys(stored, shard))
    if (dense / INDEX).is_file():
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / INDEX).write_text(json.dumps(index, indent=1) + "\n")
    skip = {INDEX, DENSE_MARKER, "config.json", *shard_names(dense)}
    for item in dense.iterdir():
        if item.is_file() and item.name not in skip:
            shutil.copy2(item, out / item.name)
    config = json.loads((dense / "config.json").read_text())
    config["quantization_config"] = quantization_config(fmt, group_size)
    (out / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    return total


def ensure(dense: Path, root: Path, fmt: str, group_size: int, device: str) -> dict[str, Any]:
    """Write ``fmt`` of ``dense`` unless a matching one is there; what was done."""
    target = quant_dir(dense, root, fmt)
    event: dict[str, Any] = {"event": "quantized", "format": fmt, "dir": str(target)}
    if is_quantized(target, dense, fmt, group_size):
        return {**event, "cached": True, "seconds": 0.0}
    start = time.perf_counter()

    def write(tmp: Path) -> int:
        written = write_sharded(dense, tmp, fmt, group_size, device)
        (tmp / MARKER).write_text(json.dumps(marker(dense, fmt, group_size)) + "\n")
        return written

    written = write_whole(target, write)
    return {**event, "cached": False, "seconds": time.perf_counter() - start, "bytes": written}


def wait_for(dense: Path, shape: LlamaShape, dtype: str, wait_s: float) -> None:
    """Return once ``dense`` is a complete build of ``shape`` in ``dtype`` (the builder's
    own test, so a stale checkpoint being replaced is not read); ``TimeoutError`` after
    ``wait_s``."""
    deadline = time.monotonic() + wait_s
    while not is_built(dense, shape, dtype):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{dense}: no complete checkpoint after {wait_s:.0f} s")
        time.sleep(POLL_S)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("dense", type=Path, help="a build_model checkpoint (waited for)")
    p.add_argument("root", type=Path, help="the quantized checkpoints go beside, in here")
    p.add_argument("--formats", default=",".join(FORMATS), help="comma separated: fp8,awq")
    p.add_argument("--group-size", type=int, default=128, help="AWQ: inputs per group")
    p.add_argument("--device", default="cuda", help="where the tensors are quantized")
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b", help="DENSE's")
    p.add_argument("--dtype", default="bfloat16", help="DENSE's")
    p.add_argument("--wait-s", type=float, default=0.0, help="wait this long for DENSE")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    wait_for(args.dense, SHAPES[args.shape], args.dtype, args.wait_s)
    with torch.inference_mode():
        for fmt in args.formats.split(","):
            done = ensure(args.dense, args.root, fmt, args.group_size, args.device)
            print(json.dumps(done), flush=True)
    return 0
