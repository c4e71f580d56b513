"""Read a GGUF checkpoint one slice at a time, under the Hugging Face names its family loads.

:class:`GGUFCheckpoint` is the GGUF twin of :class:`~model_shards.worker.checkpoint.Checkpoint`
(``names()``, ``source(name)``, ``bytes_read``); the name mapping and what llama.cpp's
converter did to a tensor (q/k rows permuted, Gemma's norms shifted) come from
:mod:`model_shards.gguf.architectures` and are undone here. A
:class:`GGUFTensorSource` is a :class:`TensorSource` (torch-order shape, ``read``) plus

* ``ggml_type``: the stored ``gguf.GGMLQuantizationType`` value;
* ``read(dim, start, end)``: float types as stored; block types dequantized to float32
  (``gguf.quants.dequantize``, bit-exact with llama.cpp), only the rows asked for, and
  for a slice of the last dim only the blocks covering it;
* ``read_blocks(row_start, row_end, col_start, col_end)``: the raw bytes of a 2-D tensor's
  rows ``[row_start, row_end)`` (un-permuted), columns ``[col_start, col_end)`` at block
  boundaries: ``uint8 [rows, (col_end - col_start) / block_size * type_size]``.

Every read is an ``os.pread`` of the rows' bytes: nothing else of the file is touched.
"""

from __future__ import annotations

import os
from pathlib import Path

import gguf
import numpy as np
import torch

from model_shards.gguf.architectures import TensorPlan, tensor_plans
from model_shards.gguf.reader import GGUFTensorInfo, read_gguf
from model_shards.worker.checkpoint import CheckpointError, OpenFiles, TensorSource

_FLOAT_DTYPES = {
    int(gguf.GGMLQuantizationType.F32): torch.float32,
    int(gguf.GGMLQuantizationType.F16): torch.float16,
    int(gguf.GGMLQuantizationType.BF16): torch.bfloat16,
}
_MAX_LISTED_TP = 64


def unpermute_rows(rows: np.ndarray, total: int, heads: int) -> np.ndarray:
    """Stored row of each HF row in ``rows`` of a q/k tensor of ``total`` rows over
    ``heads`` heads: HF row ``h·D + s·D/2 + i`` is stored at ``h·D + 2i + s``."""
    d = total // heads
    h, r = np.divmod(rows, d)
    s, i = np.divmod(r, d // 2)
    return h * d + 2 * i + s


class GGUFTensorSource(TensorSource):
    """One GGUF tensor under its HF name; see the module docstring for the reads."""

    def __init__(self, plan: TensorPlan, info: GGUFTensorInfo, checkpoint: GGUFCheckpoint) -> None:
        self.plan, self.info, self._store = plan, info, checkpoint

    @property
    def name(self) -> str:
        return self.plan.name

    @property
    def shape(self) -> tuple[int, ...]:
        return self.info.shape

    @property
    def ggml_type(self) -> int:
        return self.info.ggml_type

    @property
    def dtype(self) -> torch.dtype:
        if self.plan.shift:
            return torch.float32
        return _FLOAT_DTYPES.get(self.ggml_type, torch.float32)

    def read(self, dim: int = 0, start: int = 0, end: int | None = None) -> torch.Tensor:
        """``tensor.narrow(dim, start, end - start)`` in :attr:`dtype`, reading only its rows."""
        shape = self.shape
        end = shape[dim] if end is None else end
        if not 0 <= dim < len(shape) or not 0 <= start <= end <= shape[dim]:
            raise CheckpointError(
                f"tensor {self.name!r}: slice {start}:{end} of dim {dim} out of range {list(shape)}"
            )
        last = len(shape) - 1
        if len(shape) == 1 and self.plan.permute_heads:  # a q/k bias: permuted elements
            order = unpermute_rows(np.arange(shape[0]), shape[0], self.plan.permute_heads)
            return self._values(np.zeros(1, np.int64), 0, shape[0])[0][order[start:end]]
        rows = np.arange(int(np.prod(shape[:-1]))).reshape(shape[:-1])
        if dim == last:
            ids, col_start, col_end = rows.reshape(-1), start, end
        else:
            ids, col_start, col_end = np.take(rows, range(start, end), axis=dim), 0, shape[-1]
        out_shape = (*shape[:dim], end - start, *shape[dim + 1 :])
        return self._values(self._stored(ids.reshape(-1)), col_start, col_end).reshape(out_shape)

    def read_blocks(
        self, row_start: int, row_end: int, col_start: int = 0, col_end: int | None = None
    ) -> torch.Tensor:
        """Raw bytes of rows ``[row_start, row_end)``, columns ``[col_start, col_end)`` of a
        2-D tensor: ``uint8 [row_end - row_start, row_bytes]``; the columns must lie on
        block boundaries (``CheckpointError`` naming the tensor and the valid splits)."""
        shape = self.shape
        if len(shape) != 2:
            raise CheckpointError(
                f"tensor {self.name!r}: read_blocks takes 2-D tensors, not {list(shape)}"
            )
        col_end = shape[1] if col_end is None else col_end
        if not (0 <= row_start <= row_end <= shape[0] and 0 <= col_start <= col_end <= shape[1]):
            raise CheckpointError(
                f"tensor {self.name!r}: rows {row_start}:{row_end}, columns {col_start}:{col_end} "
                f"out of range {list(shape)}"
            )
        block, type_size = self.info.block()
        if col_start % block or col_end % block:
            raise CheckpointError(self._block_error(col_start, col_end, block))
        ids = self._stored(np.arange(row_start, row_end))
        raw = self._raw(ids, col_start // block * type_size, col_end // block * type_size)
        return torch.from_numpy(raw)

    def _block_error(self, col_start: int, col_end: int, block: int) -> str:
        cols = self.shape[1]
        fits = [t for t in range(1, _MAX_LISTED_TP + 1) if cols % t == 0 and cols // t % block == 0]
        return (
            f"tensor {self.name!r} ({self.info.type_name}, {block} elements per block): columns "
            f"{col_start}:{col_end} of {cols} do not start and end on a block boundary (multiples "
            f"of {block}); a row-parallel split of it fits --tensor-parallel-size {fits}"
        )

    def _stored(self, ids: np.ndarray) -> np.ndarray:
        heads = self.plan.permute_heads
        return unpermute_rows(ids, self.shape[0], heads) if heads else ids

    def _values(self, ids: np.ndarray, col_start: int, col_end: int) -> torch.Tensor:
        """Stored rows ``ids``, columns ``[col_start, col_end)``: ``[len(ids), cols]``."""
        block, type_size = self.info.block()
        first, last = col_start // block, -(-col_end // block)
        raw = self._raw(ids, first * type_size, last * type_size)
        if self.ggml_type in _FLOAT_DTYPES:
            values = torch.from_numpy(raw).view(_FLOAT_DTYPES[self.ggml_type])
        else:
            kind = gguf.GGMLQuantizationType(self.ggml_type)
            values = torch.from_numpy(gguf.quants.dequantize(raw, kind))
            values = values[:, col_start - first * block : col_end - first * block]
        if self.plan.shift:
            values = values.float() - self.plan.shift
        return values

    def _raw(self, ids: np.ndarray, byte_start: int, byte_end: int) -> np.ndarray:
        """Bytes ``[byte_start, byte_end)`` of each stored row in ``ids``: ``uint8 [n, bytes]``.
        Runs of consecutive rows are one read when whole rows are asked for."""
        row_bytes = self.info.nbytes // max(1, int(np.prod(self.shape[:-1])))
        width = byte_end - byte_start
        out = np.empty((len(ids), width), np.uint8)
        if len(ids) == 0 or width == 0:
            return out
        order = np.argsort(ids, kind="stable")
        sorted_ids = ids[order]
        whole = width == row_bytes
        breaks = np.flatnonzero(np.diff(sorted_ids) != 1) + 1 if whole else np.arange(1, len(ids))
        pos = 0
        for run in np.split(sorted_ids, breaks):
            offset = self.info.offset + int(run[0]) * row_bytes + byte_start
            data = self._store.pread_array(self.info.file, offset, len(run) * width, self.name)
            out[order[pos : pos + len(run)]] = data.reshape(len(run), width)
            pos += len(run)
        return out


class GGUFCheckpoint(OpenFiles):
    """Every weight of a GGUF checkpoint (file, directory or split shards) by its HF name."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        super().__init__()
        try:
            self.model = read_gguf(path)
            self.plans = tensor_plans(self.model)
        except ValueError as exc:
            raise CheckpointError(str(exc)) from exc

    def names(self) -> list[str]:
        return list(self.plans)

    def source(self, name: str) -> GGUFTensorSource:
        plan = self.plans[name]
        return GGUFTensorSource(plan, self.model.tensors[plan.gguf_name], self)

    def pread_array(self, file: Path, offset: int, nbytes: int, name: str) -> np.ndarray:
        """``nbytes`` of ``file`` from ``offset`` as ``uint8`` (counted in :attr:`bytes_read`)."""
        return np.frombuffer(self.pread(file, offset, nbytes, name), np.uint8)
