"""This machine's ceilings: matmul GFLOP/s per dtype and memory bandwidth.

Run as ``python -m benchmarks harness roofline`` (2 threads); prints one JSON object:
``{"gemm_gflops": {dtype: {"decode_64x576x1536": x, "square_N": y, "peak": max}},
"copy_gbps": z}``. Bandwidth is a large tensor copy, counting read + write bytes.

:func:`attainable_gflops` is the roofline for one decode step of a batch of ``b``
sequences: the weights are read once per step and used ``b`` times, so the
arithmetic intensity is ``2 b / bytes_per_weight`` FLOP per byte, and the ceiling
is ``min(peak, intensity × bandwidth)``.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import Any

import torch

THREADS = 2
SQUARE = 2048
COPY_BYTES = 512 * 2**20
MIN_SECONDS = 0.5
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}


def _best_rate(work: float, fn: Callable[[], object], repeats: int = 6) -> float:
    """Best ``work / seconds`` over ``repeats`` timed loops of at least MIN_SECONDS."""
    fn()
    best = 0.0
    for _ in range(repeats):
        n, start = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - start) < MIN_SECONDS:
            fn()
            n += 1
        best = max(best, work * n / elapsed)
    return best


def gemm_gflops(dtype: torch.dtype) -> dict[str, float]:
    a, b = torch.randn(64, 576, dtype=dtype), torch.randn(576, 1536, dtype=dtype)
    decode = _best_rate(2 * 64 * 576 * 1536 / 1e9, lambda: a @ b)
    x, y = torch.randn(SQUARE, SQUARE, dtype=dtype), torch.randn(SQUARE, SQUARE, dtype=dtype)
    square = _best_rate(2 * SQUARE**3 / 1e9, lambda: x @ y)
    return {"decode_64x576x1536": decode, f"square_{SQUARE}": square, "peak": max(decode, square)}


def copy_gbps() -> float:
    src = torch.ones(COPY_BYTES // 4)
    dst = torch.empty_like(src)
    return _best_rate(2 * COPY_BYTES / 1e9, lambda: dst.copy_(src))


def attainable_gflops(roofline: dict[str, Any], dtype: str, batch: int) -> float:
    peak = float(roofline["gemm_gflops"][dtype]["peak"])
    intensity = 2 * batch / DTYPE_BYTES[dtype]
    return min(peak, intensity * float(roofline["copy_gbps"]))


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0]).parse_args(argv)
    torch.set_num_threads(THREADS)
    result = {
        "threads": THREADS,
        "gemm_gflops": {name: gemm_gflops(getattr(torch, name)) for name in DTYPE_BYTES},
        "copy_gbps": copy_gbps(),
    }
    print(json.dumps(result))
    return 0
