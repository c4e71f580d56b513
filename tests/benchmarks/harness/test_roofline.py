"""The roofline of a decode step, without measuring the machine."""

from __future__ import annotations

from benchmarks.harness.roofline import attainable_gflops


def test_roofline_is_memory_bound_at_batch_one() -> None:
    roof = {"gemm_gflops": {"float32": {"peak": 100.0}}, "copy_gbps": 20.0}
    assert attainable_gflops(roof, "float32", 1) == 10.0  # 0.5 FLOP/byte × 20 GB/s
    assert attainable_gflops(roof, "float32", 64) == 100.0
