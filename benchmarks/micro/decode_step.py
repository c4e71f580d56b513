"""Where a decode step's time goes: the bench model on one rank, the engine only (no HTTP).

The throughput tables measure the whole server; this splits the engine's side of it. One
rank (tp = pp = 1, ``--threads`` op threads, ``THREADS`` by default, the backend
``shardserve serve`` picks) serves the bench model in this process. Each wave adds
``concurrency`` greedy requests at once (fresh ``PROMPT_LEN``-token prompts, ``OUTPUT_LEN``
tokens each, EOS ignored), as the load tests' closed loop does at its start, and steps the
coordinator until they are done; the first step (the prompts' prefill) is timed apart, then
every phase of the decode steps is summed by wall clock (the engine's own methods, wrapped
for the run)::

    python -m benchmarks micro decode_step [--concurrency 8,32] [--dtype float32] [--waves 3] \\
        [--threads 2] [--quantization q8_0|q4_0] [--model PATH]

``--model`` serves a checkpoint of one's own (a directory or a GGUF file; ``default``: the
packaged SmolLM2-135M-Instruct Q4_1 GGUF) instead of the bench model.

Printed per wave: its output tok/s, the prefill step, the median decode step, and per decode
step the ms of scheduling, the plan broadcast, the batch metadata, the layers' forward, the
LM head, sampling and the scheduler's update (the rest: the step's Python around them).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.harness.model import ensure_model
from benchmarks.harness.servers import free_port

THREADS, PROMPT_LEN, OUTPUT_LEN = 2, 32, 64


class PhaseClock:
    """Wall seconds spent in wrapped callables, by phase name."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    def wrap(self, owner: Any, attribute: str, phase: str) -> None:
        inner: Callable[..., Any] = getattr(owner, attribute)

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds[phase] += time.perf_counter() - start

        setattr(owner, attribute, timed)


def build(
    dtype: str,
    clock: PhaseClock,
    threads: int = THREADS,
    quantization: str | None = None,
    model: str | None = None,
) -> Any:
    """A coordinator over one in-process rank, its phases wrapped into ``clock``."""
    import model_shards.engine.coordinator as coordinator_module
    import model_shards.worker.decoder_worker as worker_module
    from model_shards.config.model import ModelConfig
    from model_shards.config.replica import ReplicaConfig
    from model_shards.parallel.comm import Comm
    from model_shards.parallel.state import init_parallel

    torch.set_num_threads(threads)
    if model == "default":
        from model_shards.launch.packaged_model import packaged_gguf

        model = str(packaged_gguf())
    model = model or str(ensure_model("main"))
    ps = init_parallel(
        0, 1, 1, master_addr="127.0.0.1", master_port=free_port(), device="cpu", timeout_s=60
    )
    cfg = ModelConfig.from_dir(model)
    replica = ReplicaConfig(model, dtype=dtype, quantization=quantization)
    worker = worker_module.Worker.build(replica, cfg, Comm.open(ps), 4096)
    coord = coordinator_module.Coordinator(
        worker, max_num_seqs=64, max_num_batched_tokens=2048, max_model_len=2048
    )
    clock.wrap(coord.scheduler, "schedule", "schedule")
    clock.wrap(coordinator_module, "broadcast_plan", "plan broadcast")
    clock.wrap(worker_module.ForwardBatch, "build", "batch metadata")
    clock.wrap(worker, "_forward", "layers (forward)")
    clock.wrap(worker.model, "compute_logits", "LM head")
    clock.wrap(worker.sampler, "sample", "sampling")
    clock.wrap(coord.scheduler, "update", "scheduler update")
    return coord


def wave(coord: Any, clock: PhaseClock, concurrency: int, rng: random.Random, tag: str) -> str:
    """One wave of ``concurrency`` requests; its line of figures."""
    from model_shards.messages import GenerateRequest, SamplingParams

    greedy = SamplingParams(temperature=0.0)
    for i in range(concurrency):
        ids = [rng.randrange(258, 40000) for _ in range(PROMPT_LEN)]
        coord.add_request(
            GenerateRequest(f"{tag}-{i}", ids, OUTPUT_LEN, sampling=greedy, ignore_eos=True)
        )
    start = time.perf_counter()
    coord.step()  # every prompt's prefill (and its first token)
    prefill_s = time.perf_counter() - start
    clock.seconds.clear()
    steps: list[float] = []
    while coord.has_work():
        t = time.perf_counter()
        coord.step()
        steps.append(time.perf_counter() - t)
    total = time.perf_counter() - start
    per_step = {k: 1000 * v / len(steps) for k, v in clock.seconds.items()}
    phases = ", ".join(f"{k} {v:.2f}" for k, v in per_step.items())
    return (
        f"c={concurrency}: {concurrency * OUTPUT_LEN / total:.0f} tok/s; prefill step "
        f"{1000 * prefill_s:.0f} ms; decode step median {1000 * statistics.median(steps):.1f} ms, "
        f"mean {1000 * sum(steps) / len(steps):.1f} ms = {phases} (ms per step)"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--concurrency", default="8,32")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--waves", type=int, default=3)
    parser.add_argument("--threads", type=int, default=THREADS, help="the rank's op threads")
    parser.add_argument("--quantization", choices=("q8_0", "q4_0"), default=None)
    parser.add_argument("--model", default=None, help="a checkpoint; default: the bench model")
    args = parser.parse_args(argv)
    clock = PhaseClock()
    coord = build(args.dtype, clock, args.threads, args.quantization, args.model)
    rng = random.Random(0)
    for c in [int(x) for x in args.concurrency.split(",")]:
        wave(coord, clock, c, rng, f"warm-{c}")
        for w in range(args.waves):
            print(wave(coord, clock, c, rng, f"c{c}-{w}"), flush=True)
    return 0
