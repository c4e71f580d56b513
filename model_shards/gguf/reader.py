"""A GGUF checkpoint's header: metadata and tensor entries (torch-order shapes, absolute
byte offsets), parsed with ``gguf.GGUFReader`` and cached per process; no tensor data read.

Tensor shapes are stored in GGUF's ``ne`` order (fastest-varying dim first); here they are
reversed into torch order, so a matrix is ``[out, in]`` and its quantization blocks run
along the last dim. Unsupported tensor types are refused here, naming the tensor.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

import gguf
import numpy as np

from model_shards.gguf.files import gguf_files

_T = gguf.GGMLQuantizationType
#: the tensor types served: float types read as stored, block types dequantized or kept
SUPPORTED_TYPES: tuple[gguf.GGMLQuantizationType, ...] = (
    _T.F32, _T.F16, _T.BF16, _T.Q4_0, _T.Q4_1, _T.Q5_0, _T.Q5_1, _T.Q8_0, _T.Q4_K, _T.Q5_K,
    _T.Q6_K,
)  # fmt: skip
FLOAT_TYPES: tuple[gguf.GGMLQuantizationType, ...] = (_T.F32, _T.F16, _T.BF16)
_MAX_ARRAY = 4096  # longer metadata arrays (the vocabulary, merges) are left out of metadata


@dataclass(frozen=True)
class GGUFTensorInfo:
    """One stored tensor: ``shape`` in torch order, ``offset`` absolute in ``file``."""

    name: str
    file: Path
    ggml_type: int
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    @property
    def type_name(self) -> str:
        return _T(self.ggml_type).name

    def block(self) -> tuple[int, int]:
        """``(elements, bytes)`` of one block along the last dim (1 and the item size for
        float types)."""
        size, type_size = gguf.GGML_QUANT_SIZES[_T(self.ggml_type)]
        return int(size), int(type_size)


@dataclass(frozen=True)
class GGUFModel:
    """A GGUF checkpoint's files (shard 1 first), metadata and tensors by GGUF name."""

    files: tuple[Path, ...]
    metadata: Mapping[str, Any]
    tensors: Mapping[str, GGUFTensorInfo]

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def field(self, key: str, default: Any = None) -> Any:
        """``{architecture}.{key}`` from the metadata, or ``default``."""
        return self.metadata.get(f"{self.architecture}.{key}", default)

    def read_floats(self, name: str) -> list[float]:
        """A small float tensor's values (rope frequency factors), read with numpy."""
        info = self.tensors[name]
        dtypes = {_T.F32: np.float32, _T.F16: np.float16}
        if info.ggml_type not in dtypes:
            raise ValueError(f"{info.file}: tensor {name!r} is {info.type_name}, not F32/F16")
        count = int(np.prod(info.shape))
        data = np.fromfile(
            info.file, dtype=dtypes[_T(info.ggml_type)], count=count, offset=info.offset
        )
        return [float(x) for x in data]


def read_gguf(path: str | os.PathLike[str]) -> GGUFModel:
    """The header of the GGUF checkpoint at ``path`` (see :func:`gguf_files`); ``ValueError``
    naming the file when it is unreadable or a tensor's type is not supported."""
    files = gguf_files(path)
    stamp = tuple((str(f), f.stat().st_mtime_ns, f.stat().st_size) for f in files)
    return _read_cached(stamp)


@functools.lru_cache(maxsize=4)
def _read_cached(stamp: tuple[tuple[str, int, int], ...]) -> GGUFModel:
    files = [Path(s[0]) for s in stamp]
    metadata: dict[str, Any] = {}
    tensors: dict[str, GGUFTensorInfo] = {}
    for i, file in enumerate(files):
        try:
            reader = gguf.GGUFReader(file)
        except (OSError, ValueError, IndexError, KeyError) as exc:
            raise ValueError(f"{file}: not a readable GGUF file ({exc})") from exc
        if i == 0:
            metadata = _metadata(reader)
        for t in reader.tensors:
            if t.name in tensors:
                raise ValueError(f"{file}: tensor {t.name!r} appears in two shards")
            tensors[t.name] = _tensor_info(file, t)
    return GGUFModel(tuple(files), MappingProxyType(metadata), MappingProxyType(tensors))


def _metadata(reader: gguf.GGUFReader) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or len(field.data) > _MAX_ARRAY:
            continue
        out[key] = field.contents()
    return out


def _tensor_info(file: Path, t: Any) -> GGUFTensorInfo:
    type_ = int(t.tensor_type)
    if type_ not in SUPPORTED_TYPES:
        raise ValueError(
            f"{file}: tensor {t.name!r} has type {_T(type_).name}, which shardserve cannot "
            f"serve; supported: {', '.join(_T(s).name for s in SUPPORTED_TYPES)}"
        )
    shape = tuple(int(d) for d in reversed(t.shape.tolist()))
    return GGUFTensorInfo(t.name, file, type_, shape, int(t.data_offset), int(t.n_bytes))
