"""How a layer's ``weight_loader`` fills a parameter from a checkpoint slice: dense, or
held quantized.

A parameter is *held quantized* when it carries a
:class:`~model_shards.quant.formats.QuantizedWeight` (``param.quant``, see :func:`quant_of`):
its dense ``data`` is then empty and the layer's GEMM is the backend's ``quantized_linear``.
Being an attribute of the parameter, it follows the parameter where it is shared (a tied LM
head).

:func:`load_rows` fills rows ``offset ..`` of a parameter from a slice of a checkpoint tensor:

* a GGUF tensor of a block type the backend keeps (``ops.quantized_types()``): its raw
  blocks (``source.read_blocks``), never dequantized; a column slice (row parallel) must
  start and end on a block boundary;
* a dense tensor with ``--quantization q8_0|q4_0`` (``ctx.quantization``): the slice,
  quantized as it is read (:func:`store_rows`);
* a weight of an AWQ / GPTQ / compressed-tensors / FP8 checkpoint
  (``worker/quant_sources.py``: ``source.read_quantized``): its slice in the holder of its
  format, kept by :mod:`.checkpoint_quant`;
* a dense matrix with ``--quantization fp8``: the slice, in FP8 with per-channel scales;
* otherwise the dense slice, dequantized by the source if it is quantized (the ``cuda``
  backend keeps no block types: its weights are dequantized to the model dtype at load).

Fused parameters may mix: a dense part of a parameter held quantized is kept as a float
segment. Biases and other 1-D parameters are always dense.
"""

from __future__ import annotations

import logging
from functools import cache

import torch
from torch import nn

from model_shards.layers.checkpoint_quant import ckpt_of, hold_part
from model_shards.layers.context import ShardContext
from model_shards.quant.formats import (
    BLOCK_TYPES,
    QUANTIZATION_METHODS,
    GGMLType,
    block_size,
    ggml_type,
)
from model_shards.quant.fp8 import quantize_weight
from model_shards.quant.quantize import quantize
from model_shards.quant.weights import QuantizedTensor, QuantizedWeight
from model_shards.worker.checkpoint import CheckpointError, TensorSource

log = logging.getLogger(__name__)

_FLOAT_TYPES = {torch.float32: GGMLType.F32, torch.float16: GGMLType.F16}
_FLOAT_TYPES[torch.bfloat16] = GGMLType.BF16


def copy_checked(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    """Copy ``src`` into ``dst``, raising with the tensor's name on a shape or dtype mismatch."""
    if dst.shape != src.shape:
        raise CheckpointError(
            f"tensor {name!r}: checkpoint slice has shape {list(src.shape)}, "
            f"expected {list(dst.shape)}"
        )
    if not src.is_floating_point():
        raise CheckpointError(f"tensor {name!r}: dtype {src.dtype} is not a floating-point dtype")
    dst.copy_(src)


def check_dim(source: TensorSource, dim: int, expected: int) -> None:
    """``CheckpointError`` naming the tensor unless ``source.shape[dim] == expected``."""
    if len(source.shape) <= dim or source.shape[dim] != expected:
        raise CheckpointError(
            f"tensor {source.name!r}: shape {list(source.shape)}, expected dim {dim} == {expected}"
        )


def keep_dense(param: nn.Parameter) -> None:
    """Mark ``param`` as always dense: its module reads the matrix itself (not through the
    backend's GEMM), so quantized sources are dequantized into it at load."""
    param.keep_dense = True  # type: ignore[attr-defined]


def quant_of(param: torch.Tensor) -> QuantizedWeight | None:
    """The quantized weight ``param`` holds, or ``None`` (a dense parameter)."""
    return getattr(param, "quant", None)


@cache
def _log_once(message: str) -> None:
    log.info(message)


def _held(param: nn.Parameter) -> QuantizedWeight:
    """``param``'s quantized weight, created (and its dense storage dropped) on first use."""
    held = quant_of(param)
    if held is None:
        held = QuantizedWeight(int(param.shape[0]), int(param.shape[1]))
        param.quant = held  # type: ignore[attr-defined]
        param.data = torch.empty(0, dtype=param.dtype, device=param.device)
    return held


def _check_cols(held: QuantizedWeight, cols: int, name: str) -> None:
    if cols != held.in_features:
        raise CheckpointError(
            f"tensor {name!r}: a slice of {cols} columns, expected {held.in_features}"
        )


def _check_fp8_rows(param: nn.Parameter, dense: torch.Tensor, name: str) -> None:
    held = ckpt_of(param)
    cols = held.in_features if held is not None else int(param.shape[1])
    if dense.dim() != 2 or dense.shape[1] != cols or not dense.is_floating_point():
        raise CheckpointError(
            f"tensor {name!r}: checkpoint slice {dense.dtype} {list(dense.shape)}, expected "
            f"a float [rows, {cols}]"
        )


def _read_blocks(
    source: TensorSource, qtype: GGMLType, dim: int, start: int, end: int
) -> torch.Tensor:
    """This slice's raw blocks, uint8 ``[rows, row_bytes]``."""
    read = source.read_blocks  # type: ignore[attr-defined]
    if dim == 0:
        return read(start, end)
    block, cols = block_size(qtype), source.shape[1]
    if start % block or end % block:
        valid = [t for t in range(1, 65) if cols % t == 0 and (cols // t) % block == 0]
        raise CheckpointError(
            f"tensor {source.name!r}: {qtype.name} blocks of {block} columns cannot be split "
            f"at columns {start}:{end}; tensor-parallel sizes that split its {cols} columns "
            f"on block boundaries: {valid}"
        )
    return read(0, source.shape[0], start, end)


def store_rows(
    ctx: ShardContext, param: nn.Parameter, offset: int, dense: torch.Tensor, name: str
) -> None:
    """Rows ``offset ..`` of ``param`` from ``dense [rows, in]`` (the whole of a 1-D
    ``param``): quantized with ``--quantization`` where the backend keeps that type and
    ``in`` is whole blocks, a float segment of a parameter held quantized, else copied."""
    chosen = getattr(param, "quantization", None) or ctx.quantization  # the vocab's: its own
    method = QUANTIZATION_METHODS.get(chosen or "")
    if getattr(param, "keep_dense", False):
        method, chosen = None, None
    if chosen == "fp8" and (param.dim() == 2 or ckpt_of(param) is not None):
        _check_fp8_rows(param, dense, name)
        hold_part(param, offset, quantize_weight(dense))
        return
    held = quant_of(param)
    if held is None and param.dim() == 2 and method is not None:
        if method in ctx.ops.quantized_types() and param.shape[1] % block_size(method) == 0:
            held = _held(param)
        else:
            _log_once(f"{ctx.quantization}: {list(param.shape)} weights stay {param.dtype}")
    if held is None:
        rows = dense.shape[0] if dense.dim() == param.dim() >= 1 else None
        if rows is not None and offset + rows <= param.shape[0]:
            copy_checked(param.data.narrow(0, offset, rows), dense, name)
        else:
            copy_checked(param.data, dense, name)
        return
    _check_cols(held, int(dense.shape[-1]), name)
    if method is not None and held.in_features % block_size(method) == 0:
        qtype, data = method, quantize(dense, method)
    else:
        qtype, data = (
            _FLOAT_TYPES[param.dtype],
            dense.to(param.dtype).contiguous().view(torch.uint8),
        )
    held.add(offset, QuantizedTensor(qtype, data.to(param.device), held.in_features))


def load_rows(
    ctx: ShardContext,
    param: nn.Parameter,
    offset: int,
    source: TensorSource,
    dim: int = 0,
    start: int = 0,
    end: int | None = None,
) -> None:
    """Fill ``param`` from ``source.read(dim, start, end)`` (the whole tensor by default):
    rows ``offset ..`` for a dim-0 slice, all rows for a dim-1 slice; quantized or dense as
    the module docstring says. ``CheckpointError`` naming the tensor on a mismatch."""
    end = source.shape[dim] if end is None else end
    qtype = ggml_type(getattr(source, "ggml_type", None) or 0)
    # held: data is empty
    is_matrix = param.dim() == 2 or quant_of(param) is not None or ckpt_of(param) is not None
    read_quantized = getattr(source, "read_quantized", None)  # worker/quant_sources.py
    if read_quantized is not None and is_matrix and not getattr(param, "keep_dense", False):
        part = read_quantized(dim, start, end)
        try:
            hold_part(param, offset, part)
        except ValueError as exc:
            raise CheckpointError(f"tensor {source.name!r}: {exc}") from exc
        return
    if qtype is not None and qtype in BLOCK_TYPES and is_matrix:
        if qtype in ctx.ops.quantized_types() and not getattr(param, "keep_dense", False):
            held = _held(param)
            _check_cols(held, source.shape[1] if dim == 0 else end - start, source.name)
            blocks = _read_blocks(source, qtype, dim, start, end).contiguous()
            held.add(offset, QuantizedTensor(qtype, blocks.to(param.device), held.in_features))
            return
        _log_once(f"{ctx.ops.name} backend: {qtype.name} weights are dequantized at load")
    store_rows(ctx, param, offset, source.read(dim, start, end), source.name)
