"""Backends: one implementation of every model op, chosen once per worker.

* ``__init__.py``: :func:`select_backend`, the choice below;
* ``base.py``: ``Backend``: every op a model runs, with its contract (shapes, step metadata);
* ``decode_stack.py``: what a backend's whole-step decode of plain layers takes and gives;
* ``future_tokens.py``: async scheduling's future token ids replaced on the device;
* ``reference.py``: plain PyTorch on any device, the numerical specification;
* ``cpu/``: the ``cpu`` backend: C++ kernels JIT-built once per machine, a packed GEMM;
* ``cuda/``: the ``cuda`` backend: Triton kernels, cuBLAS GEMMs, CUDA graphs of decode steps.

:func:`select_backend` decides from the device, the dtype and the environment:

=========  ===========================================================================
device     backend
=========  ===========================================================================
cuda       ``cuda`` (Triton kernels; a batch-invariant GEMM with ``--batch-invariant``)
cpu        ``cpu`` in float32/bfloat16 when the C++ kernels build, else ``reference``
=========  ===========================================================================

``SHARDSERVE_BACKEND=reference|cpu|cuda`` overrides the choice (``cuda`` on CPU
tensors needs ``TRITON_INTERPRET=1``: Triton's interpreter, for tests);
``SHARDSERVE_CPU_KERNELS=0`` keeps CPU ranks on the reference backend. Nothing
CPU-only (the C++ build) ever runs in a CUDA rank.

Layers call the ops of the backend they were built with and never test the device. The
``reference`` and ``cpu`` backends compute each row on its own, so a row's output never depends
on the rest of its batch; ``cuda`` only with ``--batch-invariant`` (a Triton GEMM instead of
cuBLAS, decode attention never split over the context).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

import torch

from model_shards.backends.base import Backend, PrefillMeta
from model_shards.backends.reference import ReferenceBackend

log = logging.getLogger(__name__)

BACKEND_NAMES = ("reference", "cpu", "cuda")


def _cpu_backend(dtype: torch.dtype) -> Backend:
    from model_shards.backends.cpu import build as cpu_build

    if dtype not in cpu_build.KERNEL_DTYPES:
        log.info("no fused CPU kernels for %s: the reference backend serves", dtype)
        return ReferenceBackend()
    if not cpu_build.build_and_load():
        return ReferenceBackend()  # build_and_load warned why
    from model_shards.backends.cpu.backend import CpuBackend

    return CpuBackend()


def _cuda_backend(batch_invariant: bool) -> Backend:
    from model_shards.backends.cuda.backend import CudaBackend

    return CudaBackend(batch_invariant=batch_invariant)


def select_backend(
    device: torch.device,
    dtype: torch.dtype,
    *,
    batch_invariant: bool = False,
    environ: Mapping[str, str] | None = None,
) -> Backend:
    """The backend of a worker whose tensors live on ``device`` in ``dtype``.

    ``ValueError`` for an unknown ``SHARDSERVE_BACKEND``, a ``cpu`` backend asked for on
    a GPU, or a ``cuda`` backend on CPU tensors outside Triton's interpreter.
    """
    env = os.environ if environ is None else environ
    name = env.get("SHARDSERVE_BACKEND", "").strip() or ("cuda" if device.type == "cuda" else "cpu")
    if name not in BACKEND_NAMES:
        raise ValueError(f"SHARDSERVE_BACKEND={name!r}: choose one of {BACKEND_NAMES}")
    if name == "cpu" and device.type != "cpu":
        raise ValueError(f"SHARDSERVE_BACKEND=cpu: the C++ kernels serve CPU tensors, not {device}")
    if name == "cuda" and device.type != "cuda" and env.get("TRITON_INTERPRET") != "1":
        raise ValueError("SHARDSERVE_BACKEND=cuda on CPU tensors needs TRITON_INTERPRET=1")
    if batch_invariant and name != "cuda":
        log.info("--batch-invariant: %s rows are batch-invariant already", name)
    if name == "reference":
        return ReferenceBackend()
    if name == "cpu":
        return _cpu_backend(dtype)
    return _cuda_backend(batch_invariant)


__all__ = ["BACKEND_NAMES", "Backend", "PrefillMeta", "ReferenceBackend", "select_backend"]
