"""Linear weights held as a quantized checkpoint stores them (AWQ, GPTQ, compressed-tensors,
FP8; ``--quantization fp8``): a parameter carrying a
:class:`~model_shards.quant.checkpoint_weight.CheckpointWeight` (``param.ckpt_quant``, see
:func:`ckpt_of`) has an empty ``data``; its GEMM is the backend's ``int4_linear`` /
``fp8_linear``, one call per part (:func:`checkpoint_gemm`).

After loading, :func:`adopt_backend_form` lets the backend pick the form it computes the weight
in (``Backend.prepare_checkpoint_weight``): kept as is, GGML blocks (the CPU backend's Q4_0 /
Q4_1 for 4-bit groups, then ``param.quant``) or a dense matrix (then ``param.data``).
"""

from __future__ import annotations

import torch
from torch import nn

from model_shards.backends.base import Backend
from model_shards.quant.checkpoint_weight import CheckpointPart, CheckpointWeight, part_to
from model_shards.quant.fp8 import Fp8Weight
from model_shards.quant.weights import QuantizedWeight


def ckpt_of(param: torch.Tensor) -> CheckpointWeight | None:
    """The checkpoint-quantized weight ``param`` holds, or ``None``."""
    return getattr(param, "ckpt_quant", None)


def hold_part(param: nn.Parameter, offset: int, part: CheckpointPart) -> None:
    """Rows ``offset ..`` of ``param`` are ``part`` (moved to ``param``'s device); the dense
    storage is dropped when the first part arrives. ``ValueError`` on a size mismatch."""
    held = ckpt_of(param)
    if held is None:
        held = CheckpointWeight(int(param.shape[0]), int(param.shape[1]))
        param.ckpt_quant = held  # type: ignore[attr-defined]
        param.data = torch.empty(0, dtype=param.dtype, device=param.device)
    held.add(offset, part_to(part, param.device))


def checkpoint_gemm(
    ops: Backend, x: torch.Tensor, weight: CheckpointWeight, bias: torch.Tensor | None
) -> torch.Tensor:
    """``x [T, in]`` → ``x W^T + b: [T, out]``, each part by its op into its columns."""

    def one(part: CheckpointPart, b: torch.Tensor | None) -> torch.Tensor:
        if isinstance(part, Fp8Weight):
            return ops.fp8_linear(x, part, b)
        return ops.int4_linear(x, part, b)

    if len(weight.parts) == 1 and weight.covers_all:
        return one(weight.parts[0][1], bias)
    out = x.new_zeros(*x.shape[:-1], weight.out_features)  # [T, out]
    if bias is not None:
        out += bias
    for start, part in weight.parts:
        end = start + part.out_features
        out[..., start:end] = one(part, None if bias is None else bias[start:end])
    return out


def adopt_backend_form(param: nn.Parameter, ops: Backend, dtype: torch.dtype) -> None:
    """Replace ``param``'s checkpoint-quantized weight by the backend's form of it."""
    held = ckpt_of(param)
    if held is None:
        return
    form = ops.prepare_checkpoint_weight(held, dtype)
    if isinstance(form, CheckpointWeight):
        param.ckpt_quant = form  # type: ignore[attr-defined]
        return
    del param.ckpt_quant  # type: ignore[attr-defined]
    if isinstance(form, QuantizedWeight):
        param.quant = form  # type: ignore[attr-defined]
    else:
        param.data = form
