"""The gpu-check's FP8 and AWQ runs of the 8B-shaped model, beside its bf16 run.

:func:`start_build` starts :mod:`benchmarks.gpu.quant_checkpoints` with the dense build
(it waits for the dense checkpoint, then quantizes on the device while the parity tests
run); :func:`finish_build` waits for it before anything is measured, so it never shares
the GPU with a measured server. :func:`serve_all` then serves each format as the bf16
run was served (same flags, warm-up, and the same c=1 and c=32 datasets and lengths), one
server at a time, into ``results["quant"][fmt]``: ``startup``, ``c1``, ``c32`` (as
:func:`benchmarks.gpu.serve.summarize_point` gives them) and ``bytes_per_token``.

HBM bytes a batch-1 decode step reads, weights at their stored size
(:func:`decode_bytes_per_token`): per decoder linear ``[N, K]``

- FP8 (compressed-tensors, per-channel): ``N·K`` e4m3 bytes + ``N`` float32 scales;
- AWQ (4-bit, groups of ``G`` inputs): ``N·K/2`` (qweight) + ``K/G·N`` float16 scales +
  ``K/G·N/2`` (qzeros, eight nibbles an int32);

plus the norms and the LM head as stored (``dtype``; the head is not quantized), plus the
KV of the mean context in ``dtype``; the embedding table is not read (one row a token).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from benchmarks.gpu.phases import Run, parse_events, phase
from benchmarks.gpu.procs import Proc
from benchmarks.gpu.serve import StartupFailed, scan_log, serve_command, summarize_point, wait_ready
from benchmarks.gpu.shapes import DTYPE_BYTES, LlamaShape
from benchmarks.harness import http_load
from benchmarks.harness.servers import free_port

FORMATS = ("fp8", "awq")
GROUP_SIZE = 128  # AWQ's usual; the smoke shape's 64-wide inputs need 64
SMOKE_GROUP_SIZE = 64
BUILD_WAIT_S = 240.0  # the quantizer's wait for the dense build (its own cap)
BUILD_CAP_S = 120.0  # how long the check waits for the quantizer once the dense one is there
START_CAP_S = 150.0  # each quantized server's start-up
POINTS = ("c1", "c32")
EXPECTED = tuple(f"quant.{fmt}.{point}" for fmt in FORMATS for point in POINTS)


def linear_shapes(shape: LlamaShape) -> list[tuple[int, int]]:
    """``[N, K]`` of one layer's q, k, v, o, gate, up, down."""
    h, i = shape.hidden, shape.intermediate
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    return [(q, h), (kv, h), (kv, h), (h, q), (i, h), (i, h), (h, i)]


def stored_linear_bytes(n: int, k: int, fmt: str, group_size: int) -> int:
    """Bytes one ``[N, K]`` linear is stored in (module docstring)."""
    if fmt == "fp8":
        return n * k + 4 * n
    if fmt == "awq":
        groups = k // group_size
        return n * k // 2 + groups * n * 2 + groups * n // 2
    raise ValueError(f"format {fmt!r}: choose one of {FORMATS}")


def decode_bytes_per_token(
    shape: LlamaShape, fmt: str, group_size: int, dtype: str, mean_context: float
) -> float:
    """HBM bytes one batch-1 decode step reads from the ``fmt`` checkpoint (module docstring)."""
    linears = sum(stored_linear_bytes(n, k, fmt, group_size) for n, k in linear_shapes(shape))
    norms = (2 * shape.layers + 1) * shape.hidden * DTYPE_BYTES[dtype]
    head = shape.embedding_params() * DTYPE_BYTES[dtype]
    kv = shape.kv_bytes_per_position(dtype) * mean_context
    return shape.layers * linears + norms + head + kv


def group_size(run: Run) -> int:
    return SMOKE_GROUP_SIZE if run.settings.smoke else GROUP_SIZE


def build_command(run: Run) -> list[str]:
    s = run.settings
    return [
        *(sys.executable, "-m", "benchmarks", "gpu", "quant_checkpoints"),
        *(str(s.model_dir), str(s.model_dir.parent), "--formats", ",".join(FORMATS)),
        *("--group-size", str(group_size(run)), "--device", s.device),
        *("--shape", s.shape_name, "--dtype", s.dtype, "--wait-s", str(BUILD_WAIT_S)),
    ]


def start_build(run: Run) -> Proc:
    return run.procs.start(build_command(run), run.settings.logs_dir / "quant-build.log")


def finish_build(run: Run, proc: Proc) -> dict[str, Path]:
    """Wait for the quantizer (at most :data:`BUILD_CAP_S`); the formats written, by name."""
    run.results["quant"] = {"group_size": group_size(run)}
    built: dict[str, Path] = {}
    with phase(run, "quant"):
        rc = proc.wait(run.cap("quant", BUILD_CAP_S))
        run.procs.stop(proc, grace_s=1.0)
        for event in parse_events(proc.log.read_text(errors="replace")):
            if event["event"] == "quantized":
                run.results["quant"].setdefault("build", {})[event["format"]] = event
                built[event["format"]] = Path(event["dir"])
        why = "not done in time" if rc is None else f"exited with {rc}"
        for fmt in FORMATS:
            if fmt not in built:
                run.missing(f"quant.{fmt}", f"checkpoint: quantizer {why}; {proc.log_tail(600)}")
    return built


def serve_all(run: Run, built: dict[str, Path], datasets: dict[str, str]) -> None:
    """Each written format served and measured in turn (each its own phase)."""
    for fmt in FORMATS:
        if fmt in built:
            serve_format(run, fmt, built[fmt], datasets)


def serve_format(run: Run, fmt: str, model_dir: Path, datasets: dict[str, str]) -> None:
    """Start the ``fmt`` server, run the warm-up, c=1 and c=32 points, stop it (always)."""
    s = run.settings
    key = f"quant.{fmt}"
    bytes_per_token = decode_bytes_per_token(
        s.shape, fmt, group_size(run), s.dtype, s.mean_context()
    )
    out: dict[str, Any] = {"bytes_per_token": bytes_per_token}
    run.results["quant"][fmt] = out
    with phase(run, key):
        cap = run.time_for(key, START_CAP_S)
        port = free_port()
        command = serve_command(model_dir, s.device, s.dtype, port, s.max_num_seqs, s.max_model_len)
        out["command"] = " ".join(command)
        proc = run.procs.start(command, s.logs_dir / f"server-{fmt}.log")
        try:
            try:
                out["startup"] = wait_ready(proc, f"http://127.0.0.1:{port}", cap)
            except StartupFailed as exc:
                out["startup"] = exc.startup
                raise
            _points(run, fmt, f"http://127.0.0.1:{port}", datasets)
        finally:
            run.procs.stop(proc)
            text = proc.log.read_text(errors="replace")
            out.setdefault("startup", {}).update(scan_log(text, proc.started_wall))


def _points(run: Run, fmt: str, url: str, data: dict[str, str]) -> None:
    s = run.settings
    warm = min(32, s.warmup_requests)
    _point(run, fmt, url, "warmup", data["warmup"], warm, s.warmup_requests, s.warmup_output)
    _point(run, fmt, url, "c1", data["c1"], 1, s.requests_c1, s.output_c1)
    _point(run, fmt, url, "c32", data["c32"], 32, s.requests_c32, s.output_c32)


def _point(run: Run, fmt: str, url: str, key: str, data: str, conc: int, n: int, out: int) -> None:
    name = f"quant.{fmt}.{key}"
    with phase(run, name):
        cap = run.time_for(name, run.settings.point_cap_s)
        metrics = http_load.run_point(
            url, "", data, conc, n, out, hf_serve=False, duration_s=cap, timeout_s=cap + 10
        )
        point = summarize_point(metrics, conc, run.settings.prompt_len, out)
        print(f"  {fmt} c={conc}: {point['output_tok_s']:.1f} tok/s, errors {point['errors']}")
        if key == "warmup":
            return
        run.results["quant"][fmt][key] = point
        if point["errors"]:
            run.note(f"{fmt} c={conc}: requests not completed {point['errors']} (cap {cap:.0f} s)")
