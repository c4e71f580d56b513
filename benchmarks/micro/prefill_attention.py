"""Prefill attention of the bench model: the cpu backend's fused C++ kernel against the
reference backend's path (block slots, K/V gather, one SDPA per chunk), per layer call.

For each prompt length in ``LENGTHS`` (one fresh chunk from position 0, as in
:mod:`benchmarks.suites.ttft`) and each dtype, the two are timed in alternation (``REPEATS``
rounds, each a loop of at least ``MIN_SECONDS`` per path), so that the ratio of their best
times comes from the same minutes of the machine::

    python -m benchmarks micro prefill_attention [--lengths 32,128,512] [--dtypes float32,bfloat16]
                                           [--threads 2]

The figures are only as quiet as the machine: note the load average printed with them.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable

import torch

from benchmarks.harness.model import SHAPES
from model_shards.backends.base import Backend, KVPool, PrefillMeta
from model_shards.backends.cpu.backend import CpuBackend
from model_shards.backends.cpu.build import build_and_load
from model_shards.backends.reference import ReferenceBackend

THREADS = 2
LENGTHS = (32, 128, 512)
BLOCK_SIZE = 16
MIN_SECONDS = 0.1
REPEATS = 7


def loop_seconds(fn: Callable[[], object]) -> float:
    """Seconds per call of ``fn`` over a loop of at least ``MIN_SECONDS``."""
    n, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < MIN_SECONDS:
        fn()
        n += 1
    return elapsed / n


def one_chunk(length: int, dtype: torch.dtype) -> tuple[torch.Tensor, KVPool, PrefillMeta]:
    """The bench model's q ``[T, nh, D]`` (a view of a fused qkv, as the layers pass it), a
    pool with the prompt's K/V in shuffled blocks, the meta of one chunk from position 0."""
    s, g = SHAPES["main"], torch.Generator().manual_seed(0)
    nh, nkv, d = s.heads, s.kv_heads, s.head_dim
    nblk = -(-length // BLOCK_SIZE)
    blocks = 2 * nblk + 8
    k, v = (torch.randn(blocks * BLOCK_SIZE, nkv, d, generator=g).to(dtype) for _ in range(2))
    pool = KVPool(k, v, BLOCK_SIZE)
    table = torch.randperm(blocks, generator=g)[:nblk].unsqueeze(0)  # [1, nblk]
    one = torch.zeros(1, dtype=torch.int64)
    meta = PrefillMeta(one, one + length, one, table, [0], [length], [0], BLOCK_SIZE, window=None)
    q = torch.randn(length, nh + 2 * nkv, d, generator=g).to(dtype)[:, :nh]
    return q, pool, meta


def compare(length: int, dtype: torch.dtype) -> tuple[float, float]:
    """Best seconds per call of the reference and the fused path, timed in alternation;
    checks first that they agree."""
    q, pool, meta = one_chunk(length, dtype)
    scale = q.shape[-1] ** -0.5
    outs = {name: torch.empty_like(q) for name in ("reference", "cpu")}
    backends: dict[str, Backend] = {"reference": ReferenceBackend(), "cpu": CpuBackend()}
    calls = {
        name: (lambda b=b, o=outs[name]: b.prefill_attention(q, pool, meta, scale, o))
        for name, b in backends.items()
    }
    for call in calls.values():
        call()
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(outs["cpu"].float(), outs["reference"].float(), atol=tol, rtol=tol)
    best = {name: float("inf") for name in calls}
    for _ in range(REPEATS):
        for name, call in calls.items():
            best[name] = min(best[name], loop_seconds(call))
    return best["reference"], best["cpu"]


def kernel_bench_args(
    argv: list[str] | None, doc: str, sizes_flag: str, sizes: tuple[int, ...]
) -> argparse.Namespace:
    """The flags of an attention-kernel benchmark (``sizes_flag``, ``--dtypes``,
    ``--threads``), parsed, with the kernels built and the thread count set."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument(sizes_flag, default=",".join(map(str, sizes)))
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--threads", type=int, default=THREADS)
    args = parser.parse_args(argv)
    if not build_and_load():
        raise SystemExit("the CPU kernels did not build: nothing to compare")
    torch.set_num_threads(args.threads)
    return args


def main(argv: list[str] | None = None) -> int:
    args = kernel_bench_args(argv, __doc__ or "", "--lengths", LENGTHS)
    s = SHAPES["main"]
    print(
        f"bench model: {s.heads} heads / {s.kv_heads} kv heads of {s.head_dim}, block size "
        f"{BLOCK_SIZE}, {args.threads} threads, load average {os.getloadavg()[0]:.2f}"
    )
    print("| dtype | prompt | reference (µs/layer) | fused (µs/layer) | speedup |")
    print("|---|---:|---:|---:|---:|")
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        for length in map(int, args.lengths.split(",")):
            ref, fused = compare(length, dtype)
            print(
                f"| {dtype_name} | {length} | {ref * 1e6:.1f} | {fused * 1e6:.1f} | "
                f"{ref / fused:.1f}x |"
            )
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    return 0
