"""The ``cuda`` backend: Triton kernels, cuBLAS GEMMs and CUDA graphs, for GPU ranks.

* ``backend.py``: ``CudaBackend``: every op in Triton but dense GEMMs (cuBLAS), sampling's draw;
* ``triton_ops/``: the Triton kernels, one module per op family;
* ``graphs.py``: decode-only steps as CUDA graphs: batch buckets, static inputs, capture, replay.

``--batch-invariant`` swaps cuBLAS for the Triton GEMM and keeps decode attention single-pass.
Without a GPU the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``), which is how
the tests check them against the reference backend. MoE experts have no kernel yet: the
reference's math, run densely so that decode graphs can capture it. Checkpoint-quantized
weights have their GEMMs (4-bit W4A16, FP8 W8A8 with cuBLASLt's ``_scaled_mm`` on sm89+) and
``--kv-cache-dtype fp8`` its e4m3 pools, read and written by the attention kernels.
"""
