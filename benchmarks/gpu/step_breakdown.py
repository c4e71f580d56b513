"""Where a decode step's time goes, on the checkpoint the check serves (one process, no server).

Run as ``python -m benchmarks gpu step_breakdown SPEC.json`` (``{"model_dir", "device",
"dtype", "prompt_len", "steps", "batches": [1, 32]}``). Prints one JSON line per event:

- ``{"event": "copy", "gb_s", "bytes"}``: a device-to-device copy's bandwidth (read + write
  bytes over the time), the yardstick of every other rate;
- ``{"event": "linear", "rows": [...]}``: ``F.linear`` at M = 1 and 32 on each of the
  model's weight shapes: ms, GB/s (weight + activations), % of the copy's;
- ``{"event": "fusions", "rows": [...], "errors"}``: each fused kernel against its unfused
  launches at the model's shapes (:mod:`benchmarks.gpu.fusions`): ms of both, bitwise or not;
- ``{"event": "step", "batch", "engine_ms", "replay_ms", "host_gap_ms", "graphed"}`` per
  batch: a whole engine step (``Coordinator.step``: schedule, plan, forward, sample,
  update; median of ``steps``) against the replay of the step's decode graph alone (CUDA
  events; ``null`` where no graph holds the step), their difference the host's share;
- ``{"event": "kernels", "batch", "steps", "launches_per_step", "device_us_per_step",
  "rows": [...]}``: the profiler's device entries over ``steps`` engine steps at batch 1
  (kernels and copies: their count and time a step), the top ones by device time (name,
  calls, total and per-step µs);
- ``{"event": "mixed", "decodes", "prefill", "tokens", "bucket", "eager_ms",
  "piecewise_ms"}``: a step of one prompt's prefill beside 31 decodes, eager and (with
  ``"piecewise": true`` in the spec: ``SHARDSERVE_PIECEWISE_GRAPHS``) through piecewise graphs.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.gpu.fusions import fusion_rows
from benchmarks.gpu.plain_llama import PlainConfig

TOP_KERNELS = 15


def emit(event: dict[str, Any]) -> None:
    print(json.dumps(event), flush=True)


def timed_ms(fn: Callable[[], object], device: str, reps: int, warm: int = 3) -> float:
    """Mean milliseconds of ``fn`` over ``reps`` runs (CUDA events on a GPU)."""
    for _ in range(warm):
        fn()
    if device.startswith("cuda"):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        return float(start.elapsed_time(end)) / reps
    began = time.perf_counter()
    for _ in range(reps):
        fn()
    return 1000 * (time.perf_counter() - began) / reps


def copy_bandwidth(device: str, nbytes: int, reps: int = 10) -> dict[str, Any]:
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = timed_ms(lambda: dst.copy_(src), device, reps)
    return {"event": "copy", "bytes": nbytes, "ms": ms, "gb_s": 2 * nbytes / ms / 1e6}


def weight_shapes(cfg: PlainConfig) -> dict[str, tuple[int, int]]:
    """``name → (out, in)`` of each matrix a decode step multiplies by (q/k/v and gate/up
    fused, as shardserve holds them)."""
    q, kv = cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    return {
        "qkv": (q + 2 * kv, cfg.hidden),
        "o": (cfg.hidden, q),
        "gate_up": (2 * cfg.intermediate, cfg.hidden),
        "down": (cfg.hidden, cfg.intermediate),
        "lm_head": (cfg.vocab, cfg.hidden),
    }


def linear_table(
    cfg: PlainConfig, device: str, dtype: torch.dtype, copy_gb_s: float, reps: int = 20
) -> list[dict[str, Any]]:
    rows = []
    for name, (out, inp) in weight_shapes(cfg).items():
        w = torch.randn(out, inp, device=device, dtype=dtype)
        for m in (1, 32):
            x = torch.randn(m, inp, device=device, dtype=dtype)
            ms = timed_ms(partial(F.linear, x, w), device, reps)
            moved = (w.numel() + x.numel() + m * out) * w.element_size()
            gb_s = moved / ms / 1e6
            rows.append(
                {"matrix": name, "m": m, "shape": [out, inp], "ms": ms, "gb_s": gb_s,
                 "copy_pct": 100 * gb_s / copy_gb_s if copy_gb_s else None}
            )  # fmt: skip
        del w
    return rows


def kernel_rows(prof: Any, steps: int) -> list[dict[str, Any]]:
    """The profiler's device-side entries, most device time first (µs, totals and per step)."""
    out: list[dict[str, Any]] = []
    for avg in prof.key_averages():
        total = float(getattr(avg, "self_device_time_total", 0.0) or 0.0)
        if not total:
            total = float(getattr(avg, "self_cuda_time_total", 0.0) or 0.0)
        if total > 0:
            out.append({"name": avg.key, "calls": avg.count, "total_us": float(total)})
    out.sort(key=lambda r: -r["total_us"])
    for row in out:
        row["per_step_us"] = row["total_us"] / steps
        row["calls_per_step"] = row["calls"] / steps
    return out


def _engine(spec: dict[str, Any], max_seqs: int) -> Any:
    from model_shards.config.model import ModelConfig
    from model_shards.config.replica import ReplicaConfig
    from model_shards.engine.coordinator import Coordinator
    from model_shards.parallel.comm import Comm
    from model_shards.parallel.state import single_process_state
    from model_shards.worker.decoder_worker import Worker
    from model_shards.worker.piecewise_graphs import PIECEWISE_ENV

    model_dir, device = str(spec["model_dir"]), torch.device(str(spec["device"]))
    os.environ[PIECEWISE_ENV] = "1" if spec.get("piecewise") else "0"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    max_len = int(spec["prompt_len"]) + 4 * int(spec["steps"]) + 16
    cfg = ModelConfig.from_dir(model_dir)
    replica = ReplicaConfig(model_dir, dtype=str(spec["dtype"]), max_num_seqs=max_seqs)
    worker = Worker.build(replica, cfg, Comm(single_process_state(device)), max_len)
    return Coordinator(
        worker,
        max_num_seqs=max_seqs,
        max_num_batched_tokens=4096,
        max_model_len=max_len,
        async_scheduling=spec.get("async_scheduling"),  # None: the backend's default
    )


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def start_decoding(coord: Any, batch: int, prompt_len: int, new_tokens: int, tag: str) -> None:
    """``batch`` greedy requests (seeded random prompts), stepped until each has decoded."""
    from model_shards.messages import GenerateRequest, SamplingParams

    gen = torch.Generator().manual_seed(batch)
    ids = torch.randint(3, 1000, (batch, prompt_len), generator=gen).tolist()
    for i, prompt in enumerate(ids):
        req = GenerateRequest(f"{tag}{i}", prompt, new_tokens, SamplingParams(0.0), ignore_eos=True)
        coord.add_request(req)
    seen: set[str] = set()
    while len(seen) < batch:
        seen.update(u.output.request_id for u in coord.step() if u.output.new_token_ids)


def drain(coord: Any) -> None:
    while coord.has_work():
        coord.step()
    coord.step()  # the last frees


def replay_ms(coord: Any, batch: int, context: int, device: str, reps: int) -> float | None:
    """The decode graph a ``batch``-row step at ``context`` replays, timed alone."""
    from model_shards.backends.cuda.graphs import DecodeStep

    graphs = coord.worker.graphs
    if graphs is None:
        return None
    step = DecodeStep([context - 1] * batch, [0] * batch, [[0]] * batch, [context] * batch,
                      [0] * batch, None)  # fmt: skip
    handle = graphs.runner.graph_for(step)
    if handle is None:
        return None
    return timed_ms(lambda: graphs.runner.backend.replay(handle), device, reps)


def step_point(coord: Any, spec: dict[str, Any], batch: int) -> dict[str, Any]:
    device, steps, prompt_len = str(spec["device"]), int(spec["steps"]), int(spec["prompt_len"])
    start_decoding(coord, batch, prompt_len, 3 * steps, f"b{batch}-")
    times = []
    for _ in range(steps):
        _sync(device)
        began = time.perf_counter()
        coord.step()
        _sync(device)
        times.append(1000 * (time.perf_counter() - began))
    engine = statistics.median(times)
    pumped = async_ms(coord, device, steps)
    replay = replay_ms(coord, batch, prompt_len + steps + 1, device, steps)
    drain(coord)
    return {
        "event": "step",
        "batch": batch,
        "engine_ms": engine,
        "async_ms": pumped,
        "replay_ms": replay,
        "host_gap_ms": None if replay is None else engine - replay,
        "async_gap_ms": None if replay is None or pumped is None else pumped - replay,
        "graphed": replay is not None,
    }


def async_ms(coord: Any, device: str, steps: int) -> float | None:
    """A step's mean time (ms) in the engine's own loop with async scheduling (each step
    planned and launched before the last one's tokens are back); ``None`` if it is off."""
    if not coord.async_scheduling:
        return None
    _sync(device)
    began = time.perf_counter()
    for _ in range(steps):
        coord.pump()
    _sync(device)
    return 1000 * (time.perf_counter() - began) / steps


def kernel_point(coord: Any, spec: dict[str, Any], batch: int = 1) -> dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile

    device, steps = str(spec["device"]), int(spec["steps"])
    start_decoding(coord, batch, int(spec["prompt_len"]), 3 * steps, "prof-")
    activities = [ProfilerActivity.CPU]
    if device.startswith("cuda"):
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        for _ in range(steps):
            coord.step()
        _sync(device)
    drain(coord)
    rows = kernel_rows(prof, steps)
    return {
        "event": "kernels",
        "batch": batch,
        "steps": steps,
        "launches_per_step": sum(r["calls"] for r in rows) / steps,  # every device entry
        "device_us_per_step": sum(r["total_us"] for r in rows) / steps,
        "rows": rows[:TOP_KERNELS],
    }


def mixed_point(
    coord: Any, spec: dict[str, Any], decodes: int = 31, reps: int = 5
) -> dict[str, Any]:
    """Steps of one new prompt's prefill beside ``decodes`` decodes (median ms), eager and
    through the worker's piecewise graphs (``null`` where it has none)."""
    from model_shards.messages import GenerateRequest, SamplingParams

    device, prompt_len = str(spec["device"]), int(spec["prompt_len"])
    worker, gen = coord.worker, torch.Generator().manual_seed(7)
    pieces = worker.piecewise
    start_decoding(coord, decodes, prompt_len, 3 * int(spec["steps"]), "mix-")
    medians: dict[str, float | None] = {"eager": None, "piecewise": None}
    for mode, graphs in (("eager", None), ("piecewise", pieces)):
        if mode == "piecewise" and pieces is None:
            continue
        worker.piecewise = graphs
        times = []
        for r in range(reps):
            prompt = torch.randint(3, 1000, (prompt_len,), generator=gen).tolist()
            greedy = SamplingParams(0.0)
            coord.add_request(GenerateRequest(f"new-{mode}{r}", prompt, 1, greedy, ignore_eos=True))
            _sync(device)
            began = time.perf_counter()
            coord.step()  # the prefill beside every decode
            _sync(device)
            times.append(1000 * (time.perf_counter() - began))
        medians[mode] = statistics.median(times)
    worker.piecewise = pieces
    drain(coord)
    tokens = decodes + prompt_len
    bucket = None if pieces is None else pieces.bucket(tokens)
    shape = {"decodes": decodes, "prefill": prompt_len, "tokens": tokens, "bucket": bucket}
    return {"event": "mixed", **shape, "eager_ms": medians["eager"],
            "piecewise_ms": medians["piecewise"]}  # fmt: skip


def main(argv: list[str]) -> int:
    spec: dict[str, Any] = json.loads(Path(argv[0]).read_text())
    device, dtype = str(spec["device"]), getattr(torch, str(spec["dtype"]))
    copy = copy_bandwidth(device, int(spec.get("copy_bytes", 1 << 30)))
    emit(copy)
    cfg = PlainConfig.from_dir(Path(spec["model_dir"]))
    with torch.inference_mode():
        emit({"event": "linear", "rows": linear_table(cfg, device, dtype, copy["gb_s"])})
        emit(fusion_rows(cfg, device, dtype, timed_ms))
    coord = _engine(spec, max(int(b) for b in spec["batches"]))
    for batch in spec["batches"]:
        emit(step_point(coord, spec, int(batch)))
    emit(kernel_point(coord, spec))
    emit(mixed_point(coord, spec))
    coord.shutdown()
    return 0
