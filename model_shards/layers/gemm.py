"""The GEMM behind every linear layer: ``y = x W^T (+ b)``, ``x: [T, in]``, ``W: [out, in]``.

On CPU, F.linear hands MKL a plain row-major ``W`` on every call; for the short,
wide products of decoding (a few dozen rows against a large matrix) that runs at
a third to a half of the machine's matmul peak. After loading, :func:`pack_weights`
reorders each ``W`` once for a faster GEMM:

* float32 on AVX-512 and bfloat16 on AVX-512 BF16, with the kernels built: our own
  GEMM (``model_shards/kernels/gemm_avx512.cpp``), 10-25% faster than oneDNN's on
  decode-sized batches and as fast on prefill;
* otherwise float32 and bfloat16: oneDNN's blocked layout, 1.5-3x faster than
  F.linear on decode-sized batches.

Either way the result of a row does not depend on the other rows of the batch
(tested), so batch invariance holds. A packed layer drops its dense copy unless
another module shares the parameter (a tied LM head shares the embedding table,
which lookups need dense). On GPU and in other dtypes, layers keep calling F.linear.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from model_shards.kernels import cpu_kernels_loaded

log = logging.getLogger(__name__)

_PACKABLE_DTYPES = (torch.float32, torch.bfloat16)


def _cpu_packable(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu" and weight.dtype in _PACKABLE_DTYPES


def own_gemm_supported(weight: torch.Tensor) -> bool:
    """Whether our AVX-512 GEMM serves this weight (its dtype on this CPU)."""
    return (
        _cpu_packable(weight)
        and cpu_kernels_loaded()
        and bool(torch.ops.shardserve_cpu.gemm_vectorized(weight.dtype))
    )


def onednn_supported(weight: torch.Tensor) -> bool:
    return (
        _cpu_packable(weight)
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


def packing_supported(weight: torch.Tensor) -> bool:
    return own_gemm_supported(weight) or onednn_supported(weight)


class PackableGemm(nn.Module):
    """Base of modules that own a ``weight [out, in]`` used only through :meth:`gemm`."""

    weight: nn.Parameter
    packed_weight: torch.Tensor | None = None
    packed_outputs = 0  # out features of ``packed_weight`` when our own GEMM packed it, else 0

    def pack(self, keep_dense: bool) -> bool:
        """Reorder ``weight`` for a faster GEMM; ``False`` (nothing changes) where unsupported."""
        if self.packed_weight is not None:
            return False
        weight = self.weight.detach()
        if own_gemm_supported(weight):
            self.packed_weight = torch.ops.shardserve_cpu.pack_gemm(weight)
            self.packed_outputs = weight.shape[0]
        elif onednn_supported(weight):
            self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        else:
            return False
        if not keep_dense:
            self.weight.data = torch.empty(0, dtype=self.weight.dtype)
        return True

    def gemm(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x [T, in]`` → ``[T, out]``."""
        if self.packed_outputs:
            packed, n = self.packed_weight, self.packed_outputs
            return torch.ops.shardserve_cpu.gemm(x, packed, n, bias)
        if self.packed_weight is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, bias, "none", [], "")
        return F.linear(x, self.weight, bias)


def pack_weights(model: nn.Module) -> int:
    """Pack every :class:`PackableGemm` of ``model`` (after its weights are loaded).

    Returns how many were packed.
    """
    users: dict[int, int] = {}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            users[id(param)] = users.get(id(param), 0) + 1
    packed = 0
    for module in model.modules():
        if isinstance(module, PackableGemm):
            packed += module.pack(keep_dense=users.get(id(module.weight), 0) > 1)
    if packed:
        log.debug("packed %d weight matrices", packed)
    return packed
