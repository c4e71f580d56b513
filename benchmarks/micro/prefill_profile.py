"""Where one prompt's prefill goes, by kind of op: the bench model on one rank, profiled.

The TTFT breakdown (:mod:`benchmarks.suites.ttft`) times the prefill as one stage; this splits
it. One rank (tp = pp = 1, ``THREADS`` threads, the backend ``shardserve serve`` picks)
serves the bench model in this process; after a few untimed prompts,
``torch.profiler`` records the steps that prefill ``REPEATS`` fresh ``PROMPT_LEN``-token
prompts (each step: embedding, every layer, the LM head of the last token, sampling) and
the ops are summed by kind (:data:`KINDS`: the GEMMs, attention, norms, RoPE + KV
write, ...), per prefill step::

    python -m benchmarks micro prefill_profile [--dtype bfloat16] [--prompt-len 32]
"""

from __future__ import annotations

import argparse
import os
import random
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.harness.model import SHAPES, ensure_model
from benchmarks.harness.servers import free_port

THREADS, PROMPT_LEN, REPEATS, WARMUP = 2, 32, 10, 3
#: op-name fragment → kind (first match wins; ops matching none are "other").
KINDS: tuple[tuple[str, str], ...] = (
    ("gemm", "GEMM (packed)"),
    ("linear", "GEMM (F.linear / oneDNN)"),
    ("mm", "GEMM (F.linear / oneDNN)"),
    ("attention", "attention"),
    ("rms_norm", "RMSNorm (+ residual)"),
    ("rotary", "RoPE + K/V write"),
    ("silu", "SiLU-and-mul"),
    ("embedding", "embedding"),
    ("index", "indexing (gathers of rows / blocks)"),
    ("argmax", "sampling"),
    ("exponential", "sampling"),
)


def kind_of(op: str) -> str:
    name = op.lower()
    return next((kind for part, kind in KINDS if part in name), "other")


def by_kind(prof: profile, steps: int) -> dict[str, float]:
    """Self CPU ms per step of every kind, largest first (self time: nothing twice)."""
    totals: dict[str, float] = defaultdict(float)
    for event in prof.key_averages():
        totals[kind_of(event.key)] += event.self_cpu_time_total / 1000 / steps
    return dict(sorted(totals.items(), key=lambda kv: -kv[1]))


def run(dtype: str, prompt_len: int) -> tuple[dict[str, float], float]:
    """Per-kind ms per prefill step, and the profiled wall ms per step."""
    from model_shards.config.model import ModelConfig
    from model_shards.config.replica import ReplicaConfig
    from model_shards.engine.coordinator import Coordinator
    from model_shards.messages import GenerateRequest
    from model_shards.parallel.comm import Comm
    from model_shards.parallel.state import init_parallel
    from model_shards.worker.decoder_worker import Worker

    torch.set_num_threads(THREADS)
    model = str(ensure_model("main"))
    ps = init_parallel(
        0, 1, 1, master_addr="127.0.0.1", master_port=free_port(), device="cpu", timeout_s=60
    )
    cfg = ModelConfig.from_dir(model)
    worker = Worker.build(ReplicaConfig(model, dtype=dtype), cfg, Comm.open(ps), 2048)
    coord = Coordinator(worker, max_num_seqs=4, max_num_batched_tokens=2048, max_model_len=2048)
    rng = random.Random(0)

    def prefill(i: int) -> None:
        ids = [rng.randrange(258, 1024) for _ in range(prompt_len)]
        coord.add_request(GenerateRequest(f"p{i}", ids, 1, ignore_eos=True))
        while coord.has_work():
            coord.step()

    for i in range(WARMUP):
        prefill(i)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for i in range(REPEATS):
            prefill(WARMUP + i)
    wall = sum(e.self_cpu_time_total for e in prof.key_averages()) / 1000 / REPEATS
    return by_kind(prof, REPEATS), wall


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--prompt-len", type=int, default=PROMPT_LEN)
    args = parser.parse_args(argv)
    shape = SHAPES["main"]
    head = shape.vocab * shape.hidden  # the LM head multiplies the last token only
    flops = 2 * ((shape.matmul_params() - head) * args.prompt_len + head) / 1e9
    print(f"load average {os.getloadavg()[0]:.1f}; ~{flops:.1f} GFLOP of GEMMs per prompt")
    kinds, total = run(args.dtype, args.prompt_len)
    print(f"| op kind ({args.dtype}, {args.prompt_len}-token prefill) | ms per step | share |")
    print("|---|---:|---:|")
    for kind, ms in kinds.items():
        print(f"| {kind} | {ms:.2f} | {100 * ms / total:.0f}% |")
    print(f"| all ops (self time) | {total:.2f} | |")
    return 0
