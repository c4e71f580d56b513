"""Prefill GEMMs of the bench model: the cpu backend's packed GEMM against F.linear (MKL).

For each projection shape of :data:`benchmarks.harness.model.SHAPES` ``main`` (fused QKV, o_proj,
fused gate/up, down, and the LM head) and each prompt length ``M`` in ``ROWS``, the best
GFLOP/s of ``THREADS`` threads over a few timed loops, in float32 and bfloat16, and the
ratio to the machine's matmul peak measured the same way (a 2048² square F.linear)::

    python -m benchmarks micro prefill_gemm [--rows 32,128,512] [--dtypes float32,bfloat16]

The figures are only as quiet as the machine: note the load average printed with them.
"""

from __future__ import annotations

import argparse
import functools
import os
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from benchmarks.harness.model import SHAPES

THREADS = 2
ROWS = (32, 64, 128, 256, 512)
MIN_SECONDS = 0.2
REPEATS = 5


def shapes() -> dict[str, tuple[int, int]]:
    """Projection name → (out_features, in_features) of the bench model (tp = 1)."""
    s = SHAPES["main"]
    kv = s.kv_heads * s.head_dim
    return {
        "qkv": (s.hidden + 2 * kv, s.hidden),
        "o_proj": (s.hidden, s.hidden),
        "gate_up": (2 * s.intermediate, s.hidden),
        "down": (s.hidden, s.intermediate),
        "lm_head (1 row)": (s.vocab, s.hidden),
    }


def best_gflops(flops: float, fn: Callable[[], object]) -> float:
    """Best ``flops / s`` (in GFLOP/s) over ``REPEATS`` loops of at least ``MIN_SECONDS``."""
    fn()
    best = 0.0
    for _ in range(REPEATS):
        n, start = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - start) < MIN_SECONDS:
            fn()
            n += 1
        best = max(best, flops * n / elapsed / 1e9)
    return best


def peak(dtype: torch.dtype) -> float:
    x, w = torch.randn(2048, 2048, dtype=dtype), torch.randn(2048, 2048, dtype=dtype)
    return best_gflops(2 * 2048**3, lambda: F.linear(x, w))


def measure(dtype: torch.dtype, rows: list[int]) -> list[tuple[str, int, float, float]]:
    """(shape, M, packed GFLOP/s, F.linear GFLOP/s) for every shape and M."""
    from model_shards.backends.cpu.backend import CpuBackend
    from model_shards.backends.cpu.build import build_and_load

    if not build_and_load():
        raise RuntimeError("the cpu backend's kernels did not build on this machine")
    backend = CpuBackend()
    out = []
    for name, (n, k) in shapes().items():
        w = torch.randn(n, k, dtype=dtype) / k**0.5
        packed = backend.pack_linear(w)
        for m in [1] if name.startswith("lm_head") else rows:
            x = torch.randn(m, k, dtype=dtype)
            flops = 2.0 * m * n * k
            ours = best_gflops(flops, functools.partial(backend.linear, x, w, packed, None))
            mkl = best_gflops(flops, functools.partial(F.linear, x, w))
            out.append((name, m, ours, mkl))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rows", default=",".join(map(str, ROWS)))
    parser.add_argument("--dtypes", default="float32,bfloat16")
    args = parser.parse_args(argv)
    torch.set_num_threads(THREADS)
    rows = [int(r) for r in args.rows.split(",")]
    print(f"load average {os.getloadavg()[0]:.1f}, {THREADS} threads")
    print("| dtype | shape (n × K) | M | packed GFLOP/s | F.linear GFLOP/s | packed / peak |")
    print("|---|---|---:|---:|---:|---:|")
    for name in args.dtypes.split(","):
        dtype = getattr(torch, name)
        top = peak(dtype)
        for shape, m, ours, mkl in measure(dtype, rows):
            n, k = shapes()[shape]
            print(
                f"| {name} | {shape} ({n} × {k}) | {m} | {ours:.1f} | {mkl:.1f} "
                f"| {100 * ours / top:.0f}% |"
            )
        print(f"| {name} | 2048² square F.linear (peak) | 2048 | | {top:.1f} | |")
    return 0
