"""Kernel and engine-step micro-benchmarks, not part of ``make bench``.

- ``prefill_attention``: the fused prefill attention kernel against the reference path.
- ``decode_attention``: decode attention streaming the KV cache from memory.
- ``prefill_gemm``: the packed prefill GEMM against ``F.linear``.
- ``prefill_profile``: one prompt's prefill by kind of op (``torch.profiler``).
- ``decode_step``: a decode step's phases, the engine in this process.
- ``spec_steps``: n-gram speculation on the speculative suite's prompts, the engine only: steps,
  rows, greedy identity and CPU time per kind of step.
- ``sched_share``: the CPU share of a server-shaped process (``sched_share_probe.c``).
"""
