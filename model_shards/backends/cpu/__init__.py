"""The ``cpu`` backend: fused C++ kernels and a packed GEMM, for CPU ranks in float32/bfloat16.

* ``build.py``: compile and load ``kernels/`` once per machine (``-march=native``), or warn why not;
* ``kernels/``: the C++ sources, registered as ``torch.ops.shardserve_cpu.*``;
* ``backend.py``: ``CpuBackend``: every op through those kernels; weights packed once for the GEMM;
* ``packed_gemm.py``: ``PackedGemm``, a dense weight's packed layout;
* ``decode_stack.py``: a plain stack's decode step in one native call (``Backend.decode_stack``).

Importing this package builds nothing: :func:`~model_shards.backends.select_backend` imports
``build`` for a CPU rank only, and ``backend`` only once the kernels loaded. Where they cannot
(no compiler, another dtype, ``SHARDSERVE_CPU_KERNELS=0``) the reference backend serves. The
build is cached under a name holding this CPU's feature flags, never reused on another CPU.
"""
