"""Quantized GEMMs (``kernels/quant_gemm.cpp``, or ``kernels/quant_panels.cpp`` over row panels)
against the dense bfloat16 packed GEMM (``kernels/gemm.cpp``) on SmolLM2-135M's layer shapes
(hidden 576, intermediate 1536, 9/3 heads of 64, vocab 49152), for every GGML type the kernels
serve::

    python -m benchmarks micro quant_gemm [--rows 1,8,32,128,512] [--types Q4_0,Q4_K] \
        [--layout panels|ggml]

``--layout``: ``panels`` (the default where the build has them, as the backend serves) or
``ggml`` (the blocks as the file stores them).

Each cell is ``bf16 time / quantized time`` for one shape and M (above 1: the quantized GEMM
is faster), from the best of a few timed loops on ``THREADS`` threads, activation
quantization included. Dequantizing into the bfloat16 tiles for large M would cost at least
the bfloat16 GEMM itself (plus the dequantization), so a ratio of 1 or more at an M also
says the integer path beats that alternative there. The figures are only as quiet as the
machine: note the load average printed with them.
"""

from __future__ import annotations

import argparse
import functools
import os
import time
from collections.abc import Callable

import torch

THREADS = 2
ROWS = (1, 8, 32, 128, 512)
TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")
SHAPES = {  # name -> (out_features, in_features), tp = 1
    "qkv": (576 + 2 * 3 * 64, 576),
    "o_proj": (576, 576),
    "gate_up": (2 * 1536, 576),
    "down": (576, 1536),
    "lm_head": (49152, 576),
}
MIN_SECONDS = 0.05
REPEATS = 3


def best_seconds(fn: Callable[[], object]) -> float:
    """Mean time of one call over a loop of at least ``MIN_SECONDS``."""
    fn()
    n, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < MIN_SECONDS:
        fn()
        n += 1
    return elapsed / n


def measure(types: list[str], rows: list[int], panels: bool) -> dict[tuple[str, str, int], float]:
    """(type, shape, M) → bf16 seconds / quantized seconds."""
    from model_shards.backends.cpu.backend import CpuBackend
    from model_shards.backends.cpu.build import build_and_load
    from model_shards.quant.formats import BLOCK_SIZES, GGMLType
    from model_shards.quant.panels import to_panels
    from model_shards.quant.quantize import quantize

    if not build_and_load():
        raise RuntimeError("the cpu backend's kernels did not build on this machine")
    backend, ops = CpuBackend(), torch.ops.shardserve_cpu
    ratios = {}
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k) / k**0.5
        dense = backend.pack_linear(w.bfloat16())
        for tname in types:
            qtype = GGMLType[tname]
            elems, nbytes = BLOCK_SIZES[qtype]
            if qtype in (GGMLType.Q8_0, GGMLType.Q4_0):
                blocks = quantize(w, qtype)
            elif k % elems:
                continue  # K-quants need K % 256 == 0 (576 is not: llama.cpp falls back too)
            else:  # random bytes: the timing does not depend on the values
                blocks = torch.randint(0, 256, (n, k // elems * nbytes), dtype=torch.uint8)
            if panels:
                blocks = to_panels(blocks, qtype)
            gemm = ops.quant_gemm_panels if panels else ops.quant_gemm
            for m in rows:
                x = torch.randn(m, k).bfloat16()
                ours = functools.partial(gemm, x, blocks, int(qtype))
                theirs = functools.partial(backend.linear, x, w, dense, None)
                bf16, quant = float("inf"), float("inf")
                for _ in range(REPEATS):  # interleaved, so both see the same load
                    bf16 = min(bf16, best_seconds(theirs))
                    quant = min(quant, best_seconds(ours))
                ratios[(tname, name, m)] = bf16 / quant
    return ratios


def _have_panels() -> bool:
    from model_shards.backends.cpu.build import build_and_load

    return build_and_load() and bool(torch.ops.shardserve_cpu.quant_panels_isa())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rows", default=",".join(map(str, ROWS)))
    parser.add_argument("--types", default=",".join(TYPES))
    parser.add_argument("--threads", type=int, default=THREADS)
    parser.add_argument("--layout", choices=("panels", "ggml"), default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = [int(r) for r in args.rows.split(",")]
    types = args.types.split(",")
    ratios = measure(types, rows, args.layout != "ggml" and _have_panels())
    isa = torch.ops.shardserve_cpu.quant_gemm_isa()
    if args.layout != "ggml" and _have_panels():
        isa = f"row panels, {torch.ops.shardserve_cpu.quant_panels_isa()}"
    print(f"load average {os.getloadavg()[0]:.1f}, {args.threads} threads, quant_gemm {isa}")
    print("bf16 packed GEMM time / quantized GEMM time (above 1: quantized faster)\n")
    print("| type | shape (n × K) | " + " | ".join(f"M={m}" for m in rows) + " |")
    print("|---|---|" + "---:|" * len(rows))
    for tname in types:
        for name, (n, k) in SHAPES.items():
            if (tname, name, rows[0]) not in ratios:
                continue
            cells = " | ".join(f"{ratios[(tname, name, m)]:.2f}" for m in rows)
            print(f"| {tname} | {name} ({n} × {k}) | {cells} |")
    return 0
