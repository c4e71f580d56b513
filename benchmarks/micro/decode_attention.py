"""Decode attention of the bench model: the cpu backend's kernel reading the KV cache from
memory, against the same kernel on a pool that stays in cache, and the reference backend.

A decode step at concurrency 32 reads every layer's K and V of every sequence once (about
94 MB in float32 for 30 layers at 64 tokens of context: more than the L3 cache), so the
kernel's speed is how well it streams them from memory. For each context length and dtype,
``BATCH`` sequences with their blocks shuffled through the pool (as a server's allocations
leave them) are attended:

- **from memory**: one call per layer over ``LAYERS`` pools in turn, as a step does;
- **in cache**: the same call on one pool again and again (the memory stream's ceiling);
- **reference**: the reference backend (block gather + one SDPA per sequence) on one pool.

The three are timed in alternation (``REPEATS`` rounds), so their ratios come from the same
minutes of the machine::

    python -m benchmarks micro decode_attention [--contexts 64,256] [--dtypes float32,bfloat16]
                                          [--threads 2]
"""

from __future__ import annotations

import os

import torch

from benchmarks.harness.model import SHAPES
from benchmarks.micro.prefill_attention import BLOCK_SIZE, REPEATS, kernel_bench_args, loop_seconds
from model_shards.backends.base import DecodeMeta, KVPool
from model_shards.backends.cpu.backend import CpuBackend
from model_shards.backends.reference import ReferenceBackend

BATCH = 32
CONTEXTS = (64, 256)
LAYERS = 30


def pools_and_meta(ctx: int, dtype: torch.dtype) -> tuple[torch.Tensor, list[KVPool], DecodeMeta]:
    """q ``[BATCH, nh, D]``, ``LAYERS`` pools sharing one block layout, and its meta."""
    s, g = SHAPES["main"], torch.Generator().manual_seed(0)
    per_seq = -(-ctx // BLOCK_SIZE)
    blocks = BATCH * per_seq * 2  # half the pool in use, as a running server's might be
    shape = (blocks * BLOCK_SIZE, s.kv_heads, s.head_dim)
    pools = [
        KVPool(
            torch.randn(shape, generator=g).to(dtype),
            torch.randn(shape, generator=g).to(dtype),
            BLOCK_SIZE,
        )
        for _ in range(LAYERS)
    ]
    tables = torch.randperm(blocks, generator=g)[: BATCH * per_seq].view(BATCH, per_seq)
    lens = torch.full((BATCH,), ctx, dtype=torch.int64)
    q = torch.randn(BATCH, s.heads, s.head_dim, generator=g).to(dtype)
    return q, pools, DecodeMeta(tables, lens)


def compare(ctx: int, dtype: torch.dtype) -> dict[str, float]:
    """Best seconds per layer call of each path; checks first that the kernel matches the
    reference."""
    q, pools, meta = pools_and_meta(ctx, dtype)
    scale = q.shape[-1] ** -0.5
    cpu, ref = CpuBackend(), ReferenceBackend()
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(
        cpu.decode_attention(q, pools[0], meta, scale).float(),
        ref.decode_attention(q, pools[0], meta, scale).float(),
        atol=tol,
        rtol=tol,
    )

    def from_memory() -> None:
        for pool in pools:
            cpu.decode_attention(q, pool, meta, scale)

    calls = {
        "from memory": (from_memory, LAYERS),
        "in cache": (lambda: cpu.decode_attention(q, pools[0], meta, scale), 1),
        "reference": (lambda: ref.decode_attention(q, pools[0], meta, scale), 1),
    }
    best = {name: float("inf") for name in calls}
    for _ in range(REPEATS):
        for name, (call, layers) in calls.items():
            best[name] = min(best[name], loop_seconds(call) / layers)
    return best


def main(argv: list[str] | None = None) -> int:
    args = kernel_bench_args(argv, __doc__ or "", "--contexts", CONTEXTS)
    s = SHAPES["main"]
    print(
        f"bench model: {s.heads} heads / {s.kv_heads} kv heads of {s.head_dim}, {BATCH} "
        f"sequences, block size {BLOCK_SIZE}, {args.threads} threads, load average "
        f"{os.getloadavg()[0]:.2f}"
    )
    print(
        "| dtype | context | reference (µs/layer) | in cache (µs/layer) | from memory "
        "(µs/layer) | K+V read from memory | from memory vs in cache | vs reference |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        for ctx in map(int, args.contexts.split(",")):
            t = compare(ctx, dtype)
            kv_bytes = 2 * BATCH * ctx * s.kv_heads * s.head_dim * dtype.itemsize
            print(
                f"| {dtype_name} | {ctx} | {t['reference'] * 1e6:.0f} | {t['in cache'] * 1e6:.0f}"
                f" | {t['from memory'] * 1e6:.0f} | {kv_bytes / t['from memory'] / 1e9:.1f} GB/s"
                f" | {t['in cache'] / t['from memory']:.2f}x | "
                f"{t['reference'] / t['from memory']:.1f}x |"
            )
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    return 0
