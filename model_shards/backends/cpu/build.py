"""Build and load the ``cpu`` backend's C++ kernels (:mod:`model_shards.backends.cpu.kernels`).

A small decode batch on CPU spends as long in ~50 small PyTorch ops per layer as in the GEMMs;
the kernels fuse those ops, round like :mod:`model_shards.backends.reference` and compute each
row on its own, so outputs do not depend on batch composition.

Built once per machine and checkout (``make install`` does it ahead of time) with ninja and
``-march=native`` into torch's extension cache, under a name tagged with this CPU's feature
flags and a hash of the sources. If it cannot be built, or with ``SHARDSERVE_CPU_KERNELS=0``,
backend selection warns and falls back to the reference backend. Only CPU ranks build it.
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
        "quant_gemm.cpp",
        "quant_panels.cpp",
        "decode_stack.cpp",
        "lora.cpp",
    )
]
HEADERS = [
    KERNELS_DIR / name
    for name in (
        "kernel_common.h",
        "prefill_attention.h",
        "gemm_avx2.h",
        "quant_act.h",
        "quant_dot.h",
        "quant_dot_avx2.h",
        "quant_panel_avx2.h",
        "quant_panel_avx512.h",
        "quant_panel_k_avx2.h",
        "quant_panels_avx512.h",
        "ops.h",
    )
]
KERNEL_DTYPES = (torch.float32, torch.bfloat16)  # the dtypes the kernels serve


def _cpu_tag() -> str:
    """A hash of the CPU's feature flags, so a ``-march=native`` build never loads elsewhere."""
    try:
        flags = next(
            line
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("flags")
        )
    except (OSError, StopIteration):
        flags = platform.processor()
    return hashlib.sha256(f"{platform.machine()} {flags}".encode()).hexdigest()[:10]


def _sources_tag() -> str:
    """A hash of the kernels' folder and of every source and header: part of the build's name,
    so two checkouts (or two versions of the kernels) never share a build directory. (Torch's
    own check rebuilds in place whenever a source path or text differs from the last build,
    which made checkouts side by side rebuild over each other and wait on each other's lock.)
    """
    digest = hashlib.sha256(str(KERNELS_DIR.resolve()).encode())
    for path in [*SOURCES, *HEADERS]:
        digest.update(path.name.encode() + path.read_bytes())
    return digest.hexdigest()[:10]


@cache
def build_and_load() -> bool:
    """Build (once per machine) and load the extension; ``False`` if unavailable or turned off.
    Puts ninja on this process's ``PATH``."""
    if os.environ.get("SHARDSERVE_CPU_KERNELS", "1") == "0":
        return False
    if platform.machine() not in ("x86_64", "AMD64", "aarch64", "arm64"):
        return False
    try:
        import ninja
        from torch.utils.cpp_extension import load

        os.environ["PATH"] = f"{ninja.BIN_DIR}{os.pathsep}{os.environ.get('PATH', '')}"
        load(
            name=f"shardserve_cpu_ops_{_cpu_tag()}_{_sources_tag()}",
            sources=[str(path) for path in SOURCES],
            extra_cflags=["-O3", "-march=native", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            is_python_module=False,
        )
    except Exception as exc:  # no compiler, no ninja, a build error: fall back, loudly
        log.warning("CPU kernels unavailable, using PyTorch ops (slower): %s", exc)
        return False
    return True
