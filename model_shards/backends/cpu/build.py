"""The ``cpu`` backend's fused kernels, compiled from the C++ sources of
``model_shards/backends/cpu/kernels/`` (listed in that package's docstring) once per machine.

Decoding a small batch on CPU spends as long in the ~50 small PyTorch ops per
layer (norms, rotary, K/V gather, attention, SiLU) as in the GEMMs. The ops
of ``cpu_ops.cpp`` and ``decode_attention.cpp`` do that work in one pass each:

* ``rms_norm(x, residual?, w, eps)``: (residual += x, then) RMSNorm;
* ``rotary_and_cache(qkv, positions, cos, sin, k_pool, v_pool, slots, nh, nkv)``:
  RoPE on q and k in place, K/V written to their cache slots;
* ``decode_attention(q, k_pool, v_pool, block_tables, lens, block_size, scale)``:
  single-token attention read straight from the paged pool (no gather); with
  AVX-512 (float32) or AVX-512 BF16 (bfloat16) it runs the vectorized kernel of
  ``decode_attention_avx512.cpp``, and ``vectorized=False`` selects the portable one;
* ``prefill_attention(q, k_pool, v_pool, out, block_tables, q_starts, q_lens,
  start_positions, block_size, scale, window)`` (``prefill_attention*.cpp``): causal
  attention of every prefill chunk of a step, written into ``out``, read straight from
  the paged pool (prefix-cached context and sliding windows included);
* ``silu_and_mul(x)``: ``silu(gate) * up``;
* ``argmax(x)``: the row argmax of greedy sampling.

``sampling_ops.cpp`` holds ``exponential_race(probs, seeds)``, the random draw of
sampling (one per row), and ``gemm.cpp`` (with ``gemm_avx2.h``) the float32 and bfloat16
GEMM of the linear layers (``pack_gemm``, ``gemm``, ``gemm_isa``; see
:mod:`model_shards.backends.cpu.backend`).

They round like the reference backend (:mod:`model_shards.backends.reference`) and
compute each row on its own, so outputs do not depend on batch composition.

The extension is built with the machine's C++ compiler (ninja, ``-march=native``)
into torch's extension cache, under a name that includes this CPU's feature
flags, once per machine (~15 s; ``make install`` does it ahead of time). Where it
cannot be built, or with ``SHARDSERVE_CPU_KERNELS=0``, the backend selection picks the
reference backend instead, with a warning. Only CPU ranks ever build it.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
from functools import cache
from pathlib import Path

import torch

log = logging.getLogger(__name__)

KERNELS_DIR = Path(__file__).parent / "kernels"
SOURCES = [
    KERNELS_DIR / name
    for name in (
        "cpu_ops.cpp",
        "decode_attention.cpp",
        "decode_attention_avx512.cpp",
        "prefill_attention.cpp",
        "prefill_attention_avx512.cpp",
        "sampling_ops.cpp",
        "gemm.cpp",
    )
]
HEADERS = [KERNELS_DIR / name for name in ("kernel_common.h", "prefill_attention.h", "gemm_avx2.h")]
KERNEL_DTYPES = (torch.float32, torch.bfloat16)  # the dtypes the kernels serve


def _cpu_tag() -> str:
    """Changes with the CPU's feature flags, so a ``-march=native`` build is never reused
    on a machine that lacks its instructions."""
    try:
        flags = next(
            line
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("flags")
        )
    except (OSError, StopIteration):
        flags = platform.processor()
    return hashlib.sha256(f"{platform.machine()} {flags}".encode()).hexdigest()[:10]


def _headers_tag() -> str:
    """Changes with the headers' text: torch re-builds an extension when a source or a flag
    changes, and this tag in the flags brings the headers in."""
    text = b"".join(path.read_bytes() for path in HEADERS)
    return hashlib.sha256(text).hexdigest()[:10]


@cache
def build_and_load() -> bool:
    """Build the extension (first time on this machine: puts ninja on ``PATH`` and runs the
    compiler) and load it into this process; ``False`` if unavailable or turned off."""
    if os.environ.get("SHARDSERVE_CPU_KERNELS", "1") == "0":
        return False
    if platform.machine() not in ("x86_64", "AMD64", "aarch64", "arm64"):
        return False
    try:
        import ninja
        from torch.utils.cpp_extension import load

        os.environ["PATH"] = f"{ninja.BIN_DIR}{os.pathsep}{os.environ.get('PATH', '')}"
        load(
            name=f"shardserve_cpu_ops_{_cpu_tag()}",
            sources=[str(path) for path in SOURCES],
            extra_cflags=["-O3", "-march=native", "-fopenmp", f"-DHEADERS={_headers_tag()}"],
            extra_ldflags=["-fopenmp"],
            is_python_module=False,
        )
    except Exception as exc:  # no compiler, no ninja, a build error: fall back, loudly
        log.warning("CPU kernels unavailable, using PyTorch ops (slower): %s", exc)
        return False
    return True
