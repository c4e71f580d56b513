"""The GEMM behind every linear layer: ``y = x W^T (+ b)``, ``x: [T, in]``, ``W: [out, in]``.

On CPU, F.linear hands MKL a plain row-major ``W`` on every call; for the short,
wide products of decoding (a few dozen rows against a large matrix) that runs at
a third to a half of the machine's matmul peak. oneDNN can instead take ``W``
reordered once into its blocked layout (:func:`pack_weights`, after loading)
and then runs those products 1.5–3× faster; the results are the same for a row
whatever else is in the batch (tested), so batch invariance holds.

Packing applies to float32 and bfloat16 weights on CPU. A packed layer drops its
dense copy unless another module shares the parameter (a tied LM head shares
the embedding table, which lookups need dense). On GPU and in other dtypes,
layers keep calling F.linear.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)

_PACKABLE_DTYPES = (torch.float32, torch.bfloat16)


def packing_supported(weight: torch.Tensor) -> bool:
    return (
        weight.device.type == "cpu"
        and weight.dtype in _PACKABLE_DTYPES
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


class PackableGemm(nn.Module):
    """Base of modules that own a ``weight [out, in]`` used only through :meth:`gemm`."""

    weight: nn.Parameter
    packed_weight: torch.Tensor | None = None

    def pack(self, keep_dense: bool) -> bool:
        """Reorder ``weight`` for oneDNN; ``False`` (nothing changes) where unsupported."""
        if self.packed_weight is not None or not packing_supported(self.weight):
            return False
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), None)
        if not keep_dense:
            self.weight.data = torch.empty(0, dtype=self.weight.dtype)
        return True

    def gemm(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x [T, in]`` → ``[T, out]``."""
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
        log.debug("packed %d weight matrices for oneDNN", packed)
    return packed
