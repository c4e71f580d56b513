"""Write a random Llama checkpoint straight from tensors (no ``transformers`` model built).

Run as ``python -m benchmarks gpu build_model DIR --shape llama3-8b --device cuda``. The
tensors are drawn on ``--device`` (``N(0, 0.02)``, seeded; norms are ones), copied to
the host one shard at a time and written with ``safetensors.torch.save_file``: one shard
for the embedding, one per layer, one for the final norm and LM head, plus
``model.safetensors.index.json``, ``config.json``, ``generation_config.json`` and the
built-in 1024-token byte-level BPE tokenizer (its builder cannot reach 128 256 entries,
so prompts are exact id sequences of that small vocabulary).

The LM-head rows of the 256 single-byte tokens and of ids ≥ 1024 are zero, so that
greedy decoding of random weights picks ids the tokenizer decodes into text (a server
then streams text, not only usage); the head still multiplies every row, so the work
and bytes per token are those of the full shape.

The directory is written under a temporary name and renamed; a ``gpu_check_model.json``
that matches the requested shape and dtype marks it complete, and a rerun returns at
once. Prints one JSON line: ``{"cached", "build_s", "bytes", "parameters"}``.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from benchmarks.gpu.shapes import SHAPES, LlamaShape
from benchmarks.harness.whole_dir import write_whole
from model_shards.launch.default_model import (
    BOS_TOKEN_ID,
    DEFAULT_VOCAB_SIZE,
    EOS_TOKEN_ID,
    write_tokenizer,
)

VERSION = "v1"  # bump when the bytes change
MARKER = "gpu_check_model.json"
INDEX = "model.safetensors.index.json"
SEED = 0
STD = 0.02
BYTE_TOKENS = slice(2, 2 + 256)


def marker(shape: LlamaShape, dtype: str) -> dict[str, Any]:
    return {"version": VERSION, "dtype": dtype, "shape": shape.to_json()}


def is_built(path: Path, shape: LlamaShape, dtype: str) -> bool:
    try:
        return bool(json.loads((path / MARKER).read_text()) == marker(shape, dtype))
    except (OSError, ValueError):
        return False


class _Drawer:
    """Seeded ``N(0, STD)`` tensors on one device, in one dtype."""

    def __init__(self, device: str, dtype: torch.dtype) -> None:
        self.device, self.dtype = device, dtype
        self.gen = torch.Generator(device=device).manual_seed(SEED)

    def normal(self, *shape: int) -> torch.Tensor:
        out = torch.empty(shape, device=self.device, dtype=self.dtype)
        return out.normal_(0.0, STD, generator=self.gen)

    def ones(self, n: int) -> torch.Tensor:
        return torch.ones(n, device=self.device, dtype=self.dtype)


def layer_tensors(shape: LlamaShape, i: int, draw: _Drawer) -> dict[str, torch.Tensor]:
    """Layer ``i``'s weights under Hugging Face names, ``[out_features, in_features]``."""
    h, q, kv = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    p = f"model.layers.{i}"
    return {
        f"{p}.self_attn.q_proj.weight": draw.normal(q, h),
        f"{p}.self_attn.k_proj.weight": draw.normal(kv, h),
        f"{p}.self_attn.v_proj.weight": draw.normal(kv, h),
        f"{p}.self_attn.o_proj.weight": draw.normal(h, q),
        f"{p}.mlp.gate_proj.weight": draw.normal(shape.intermediate, h),
        f"{p}.mlp.up_proj.weight": draw.normal(shape.intermediate, h),
        f"{p}.mlp.down_proj.weight": draw.normal(h, shape.intermediate),
        f"{p}.input_layernorm.weight": draw.ones(h),
        f"{p}.post_attention_layernorm.weight": draw.ones(h),
    }


def head_tensors(shape: LlamaShape, draw: _Drawer) -> dict[str, torch.Tensor]:
    head = draw.normal(shape.vocab, shape.hidden)  # [vocab, hidden]
    head[BYTE_TOKENS].zero_()
    head[DEFAULT_VOCAB_SIZE:].zero_()
    return {"model.norm.weight": draw.ones(shape.hidden), "lm_head.weight": head}


def shard_groups(shape: LlamaShape, draw: _Drawer) -> Iterator[dict[str, torch.Tensor]]:
    """The shards' tensors in order: embedding, each layer, final norm + LM head."""
    yield {"model.embed_tokens.weight": draw.normal(shape.vocab, shape.hidden)}
    for i in range(shape.layers):
        yield layer_tensors(shape, i, draw)
    yield head_tensors(shape, draw)


def write_weights(path: Path, shape: LlamaShape, device: str, dtype: str) -> int:
    """Every shard and the index; returns the bytes of tensor data written."""
    draw = _Drawer(device, getattr(torch, dtype))
    n = shape.layers + 2
    weight_map: dict[str, str] = {}
    total = 0
    for k, group in enumerate(shard_groups(shape, draw)):
        name = f"model-{k + 1:05d}-of-{n:05d}.safetensors"
        host = {key: t.contiguous().cpu() for key, t in group.items()}
        save_file(host, str(path / name), metadata={"format": "pt"})
        total += sum(t.numel() * t.element_size() for t in host.values())
        weight_map.update(dict.fromkeys(host, name))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / INDEX).write_text(json.dumps(index, indent=1) + "\n")
    return total


def write_checkpoint(path: Path, shape: LlamaShape, device: str, dtype: str) -> int:
    path.mkdir(parents=True, exist_ok=True)
    write_tokenizer(path, DEFAULT_VOCAB_SIZE, shape.max_positions)
    config = shape.hf_config(dtype, BOS_TOKEN_ID, EOS_TOKEN_ID)
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {"bos_token_id": BOS_TOKEN_ID, "eos_token_id": EOS_TOKEN_ID}
    (path / "generation_config.json").write_text(json.dumps(generation) + "\n")
    written = write_weights(path, shape, device, dtype)
    (path / MARKER).write_text(json.dumps(marker(shape, dtype)) + "\n")
    return written


def ensure(target: Path, shape: LlamaShape, device: str, dtype: str) -> dict[str, Any]:
    """Build ``target`` unless a matching build is there; what was done, as a dict."""
    if is_built(target, shape, dtype):
        return {"cached": True, "build_s": 0.0, "parameters": shape.total_params()}
    start = time.perf_counter()
    written = write_whole(target, lambda tmp: write_checkpoint(tmp, shape, device, dtype))
    return {
        "cached": False,
        "build_s": time.perf_counter() - start,
        "bytes": written,
        "parameters": shape.total_params(),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("dir", type=Path)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args(argv)
    with torch.inference_mode():
        done = ensure(args.dir, SHAPES[args.shape], args.device, args.dtype)
    print(json.dumps(done), flush=True)
    return 0
