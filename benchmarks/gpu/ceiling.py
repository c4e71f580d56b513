"""The same-GPU ceiling: the checkpoint's weights in :class:`~benchmarks.gpu.plain_llama.
PlainLlama` under ``torch.compile(mode="reduce-overhead")`` (gpt-fast's recipe), decode tok/s.

Run as ``python -m benchmarks gpu ceiling SPEC.json`` (a subprocess of the check, killed at
its cap, its GPU memory freed). The spec: ``{"model_dir", "device", "dtype", "prompt_len",
"new_tokens", "batches": [1, 32], "compile": true}``. Prints one JSON line per event:

- ``{"event": "loaded", "load_s"}`` once the weights are on the device;
- ``{"event": "point", "batch", "compile_s", "steps", "seconds", "step_ms", "tok_s"}`` per
  batch: an eager prefill of ``prompt_len`` tokens (random ids, seeded), three untimed
  compiled decode steps (compilation and graph capture: ``compile_s``), then
  ``new_tokens`` timed decode steps, each feeding its greedy token to the next;
  tok/s = batch × steps / seconds (decode only, the prefill excluded).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.gpu.plain_llama import PlainConfig, PlainLlama, read_weights

WARM_STEPS = 3


def emit(event: dict[str, Any]) -> None:
    print(json.dumps(event), flush=True)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run_point(
    cfg: PlainConfig, weights: dict[str, torch.Tensor], spec: dict[str, Any], batch: int
) -> dict[str, Any]:
    device, prompt_len, steps = (
        str(spec["device"]),
        int(spec["prompt_len"]),
        int(spec["new_tokens"]),
    )
    max_len = prompt_len + WARM_STEPS + steps + 1
    model = PlainLlama(cfg, weights, batch, max_len)
    decode: Any = model
    if spec.get("compile", True):
        decode = torch.compile(model, mode="reduce-overhead", fullgraph=True)
    gen = torch.Generator().manual_seed(batch)
    prompts = torch.randint(3, 1000, (batch, prompt_len), generator=gen).to(device)
    token = model(prompts, torch.arange(prompt_len, device=device))[:, -1].argmax(-1)
    pos = prompt_len

    def step(token: torch.Tensor, pos: int) -> torch.Tensor:
        at = torch.tensor([pos], device=device)
        return decode(token[:, None], at)[:, -1].argmax(-1)  # [B]

    start = time.perf_counter()
    for _ in range(WARM_STEPS):
        token, pos = step(token, pos), pos + 1
    sync(device)
    compile_s = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(steps):
        token, pos = step(token, pos), pos + 1
    sync(device)
    seconds = time.perf_counter() - start
    return {
        "event": "point",
        "batch": batch,
        "compile_s": compile_s,
        "steps": steps,
        "seconds": seconds,
        "step_ms": 1000 * seconds / steps,
        "tok_s": batch * steps / seconds,
    }


def main(argv: list[str]) -> int:
    spec: dict[str, Any] = json.loads(Path(argv[0]).read_text())
    model_dir, device = Path(spec["model_dir"]), str(spec["device"])
    start = time.perf_counter()
    cfg = PlainConfig.from_dir(model_dir)
    weights = read_weights(model_dir, device, getattr(torch, str(spec["dtype"])))
    sync(device)
    emit({"event": "loaded", "load_s": time.perf_counter() - start})
    with torch.no_grad():  # not inference_mode: compiled graphs keep their own tensors
        for batch in spec["batches"]:
            emit(run_point(cfg, weights, spec, int(batch)))
            if device.startswith("cuda"):
                torch.cuda.empty_cache()  # the point's KV cache and graphs
    return 0
