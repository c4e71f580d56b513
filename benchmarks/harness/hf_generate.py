"""Hugging Face padded-batch ``generate()`` on the benchmark checkpoint, in one process.

Run as ``python -m benchmarks harness hf_generate MODEL_DIR DTYPE PROMPTS.json CAP_S CONC:N ...``
(the runner starts it as a subprocess with a timeout). For each ``CONC:N`` it
generates ``N`` requests in batches of ``CONC`` (left-padded, attention mask given,
greedy, ``min_new_tokens = max_new_tokens``) and prints one JSON line per point:
``{"concurrency", "requests", "output_tokens", "duration_s", "output_throughput"}``.
One untimed warm-up batch of 1 runs first. A point stops starting new batches once it
has run ``CAP_S`` seconds (the batches done count).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
import transformers

THREADS = 2


def generate_point(
    model: transformers.PreTrainedModel,
    prompts: list[list[int]],
    batch: int,
    output_len: int,
    pad_id: int,
    cap_s: float = float("inf"),
) -> dict[str, Any]:
    start = time.perf_counter()
    produced = done = 0
    for i in range(0, len(prompts), batch):
        if time.perf_counter() - start > cap_s:
            break
        chunk = prompts[i : i + batch]
        width = max(len(p) for p in chunk)
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in chunk])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
        out = model.generate(  # type: ignore[operator]
            input_ids=ids,
            attention_mask=mask,
            do_sample=False,
            max_new_tokens=output_len,
            min_new_tokens=output_len,
            pad_token_id=pad_id,
        )
        produced += (out.shape[1] - width) * len(chunk)
        done += len(chunk)
    elapsed = time.perf_counter() - start
    return {
        "concurrency": batch,
        "requests": done,
        "output_tokens": produced,
        "duration_s": elapsed,
        "output_throughput": produced / elapsed,
    }


def main(argv: list[str]) -> int:
    model_dir, dtype, prompts_path, cap_s, *points = argv
    torch.set_num_threads(THREADS)
    spec: dict[str, Any] = json.loads(Path(prompts_path).read_text())
    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=getattr(torch, dtype)
    ).eval()
    pad_id = int(spec["pad_id"])
    with torch.inference_mode():
        generate_point(model, spec["prompts"][:1], 1, 4, pad_id)  # warm-up
        for point in points:
            conc, count = (int(x) for x in point.split(":"))
            prompts = spec["prompts"][:count]
            print(
                json.dumps(
                    generate_point(model, prompts, conc, spec["output_len"], pad_id, float(cap_s))
                )
            )
            sys.stdout.flush()
    return 0
