"""Hugging Face ``generate()`` on one device: load time and greedy tok/s per batch size.

Run as ``python -m benchmarks gpu hf_bench SPEC.json`` (the check starts it as a
subprocess, so a hung or slow load can be killed and its GPU memory is freed). The spec:
``{"model_dir", "device", "dtype", "points": [{"name", "batch", "new_tokens",
"prompts": [[id, ...], ...]}]}``. Prints one JSON line per event, flushed, so a run
killed part-way still leaves what it measured:

- ``{"event": "loaded", "load_s", "load_path"}`` after ``from_pretrained`` and the move;
- ``{"event": "point", "name", "batch", "new_tokens", "output_tokens", "seconds",
  "tok_s"}`` per point: one untimed 2-token warm-up at that batch, then one timed
  greedy ``generate`` of the point's first ``batch`` prompts (equal lengths: no
  padding), ``min_new_tokens = max_new_tokens`` so EOS cannot stop it early.

tok/s = batch × new tokens / seconds, the prompt's prefill included (as for a server).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
import transformers


def emit(event: dict[str, Any]) -> None:
    print(json.dumps(event), flush=True)


def load(model_dir: str, device: str, dtype: str) -> tuple[Any, str]:
    """The model on ``device``: straight there via ``device_map`` when that works."""
    dt = getattr(torch, dtype)
    if device != "cpu":
        try:
            model = transformers.AutoModelForCausalLM.from_pretrained(
                model_dir, dtype=dt, device_map=device
            )
            return model.eval(), "device_map"
        except (ImportError, ValueError) as exc:  # no accelerate, say
            print(f"device_map load failed ({exc}); loading on the host", file=sys.stderr)
    host: Any = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dt)
    return host.to(device).eval(), "host then .to(device)"


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def greedy(model: Any, ids: torch.Tensor, new_tokens: int, device: str) -> tuple[int, float]:
    """One ``generate`` call; (new tokens produced over the batch, seconds)."""
    sync(device)
    start = time.perf_counter()
    out = model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        pad_token_id=0,
    )
    sync(device)
    seconds = time.perf_counter() - start
    return (out.shape[1] - ids.shape[1]) * ids.shape[0], seconds


def run_point(model: Any, point: dict[str, Any], device: str) -> dict[str, Any]:
    batch, new_tokens = int(point["batch"]), int(point["new_tokens"])
    ids = torch.tensor(point["prompts"][:batch], device=device)  # [batch, prompt_len]
    if ids.shape[0] != batch:
        raise ValueError(f"point {point['name']}: {ids.shape[0]} prompts for batch {batch}")
    greedy(model, ids, 2, device)  # warm-up: kernels, allocator, caches at this batch
    produced, seconds = greedy(model, ids, new_tokens, device)
    return {
        "event": "point",
        "name": point["name"],
        "batch": batch,
        "new_tokens": new_tokens,
        "output_tokens": produced,
        "seconds": seconds,
        "tok_s": produced / seconds,
    }


def main(argv: list[str]) -> int:
    spec: dict[str, Any] = json.loads(Path(argv[0]).read_text())
    device = str(spec["device"])
    start = time.perf_counter()
    model, how = load(str(spec["model_dir"]), device, str(spec["dtype"]))
    sync(device)
    emit({"event": "loaded", "load_s": time.perf_counter() - start, "load_path": how})
    with torch.inference_mode():
        for point in spec["points"]:
            emit(run_point(model, point, device))
    return 0
