"""Read Hugging Face safetensors checkpoints one slice at a time.

A checkpoint is ``model.safetensors`` or several shards listed by
``model.safetensors.index.json``. We parse the headers ourselves (8-byte
little-endian length, JSON header, raw row-major data) so a rank can read the
exact byte ranges of *its* slice with ``os.pread`` — no mmap of the whole file,
no full tensor materialised. :attr:`Checkpoint.bytes_read` counts the tensor
bytes actually read, for tests and logs.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, Self

import torch

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
_MAX_HEADER = 100 * 1024 * 1024

_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,  # FP8 checkpoints (compressed-tensors, FBGEMM)
}


class CheckpointError(ValueError):
    """A missing, corrupt or inconsistent checkpoint file; the message names it."""


@dataclass(frozen=True)
class TensorEntry:
    name: str
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # absolute byte offset of the data in ``file``
    nbytes: int


def _read_header(path: Path) -> list[TensorEntry]:
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            raw_len = f.read(8)
            if len(raw_len) != 8:
                raise CheckpointError(f"{path}: truncated safetensors file (no header)")
            header_len = int.from_bytes(raw_len, "little")
            if header_len > min(_MAX_HEADER, size - 8):
                raise CheckpointError(f"{path}: corrupt safetensors header length {header_len}")
            header = json.loads(f.read(header_len))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: unreadable safetensors header ({exc})") from exc
    base = 8 + header_len
    entries = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = _DTYPES[info["dtype"]]
            shape = tuple(int(d) for d in info["shape"])
            start, end = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"{path}: bad header entry for tensor {name!r}") from exc
        numel = 1
        for d in shape:
            numel *= d
        nbytes = numel * dtype.itemsize
        if end - start != nbytes or base + end > size:
            raise CheckpointError(
                f"{path}: tensor {name!r} data {start}..{end} inconsistent with "
                f"shape {list(shape)} {info['dtype']} or file size {size}"
            )
        entries.append(TensorEntry(name, path, dtype, shape, base + start, nbytes))
    return entries


class TensorSource:
    """One checkpoint tensor that can be read whole or as a narrow slice."""

    def __init__(self, entry: TensorEntry, checkpoint: Checkpoint) -> None:
        self.entry = entry
        self._checkpoint = checkpoint

    @property
    def name(self) -> str:
        return self.entry.name

    @property
    def shape(self) -> tuple[int, ...]:
        return self.entry.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.entry.dtype

    def read(self, dim: int = 0, start: int = 0, end: int | None = None) -> torch.Tensor:
        """Return ``tensor.narrow(dim, start, end - start)``, reading only those bytes.

        Slicing dim 0 is one contiguous read; slicing dim ``d`` reads one run per
        index of the dims before ``d``.
        """
        shape = self.shape
        if not shape:
            return self._pread(self.entry.offset, self.entry.nbytes).reshape(())
        end = shape[dim] if end is None else end
        if not 0 <= start <= end <= shape[dim]:
            raise CheckpointError(
                f"tensor {self.name!r}: slice {start}:{end} of dim {dim} out of range {list(shape)}"
            )
        outer = 1
        for d in shape[:dim]:
            outer *= d
        inner = 1
        for d in shape[dim + 1 :]:
            inner *= d
        item = self.dtype.itemsize
        run = (end - start) * inner * item
        stride = shape[dim] * inner * item
        first = self.entry.offset + start * inner * item
        out_shape = (*shape[:dim], end - start, *shape[dim + 1 :])
        if outer == 1 or run == stride:
            flat = self._pread(first, run * outer)
        else:
            flat = torch.cat([self._pread(first + i * stride, run) for i in range(outer)])
        return flat.reshape(out_shape)

    def _pread(self, offset: int, nbytes: int) -> torch.Tensor:
        buf = self._checkpoint.pread(self.entry.file, offset, nbytes, self.name)
        if nbytes == 0:
            return torch.empty(0, dtype=self.dtype)
        return torch.frombuffer(buf, dtype=self.dtype)


class TensorStore(Protocol):
    """What the loader reads: a checkpoint's tensor names and a source for each (this
    module's :class:`Checkpoint`, or ``worker/gguf_checkpoint.py``'s ``GGUFCheckpoint``)."""

    bytes_read: int

    def names(self) -> Iterable[str]: ...

    def source(self, name: str) -> TensorSource: ...


class StoreView:
    """A :class:`TensorStore` over another, ``store``: its bytes read are the other's, and by
    default its names and sources too (a subclass filters or regroups them)."""

    def __init__(self, store: TensorStore) -> None:
        self.store = store

    @property
    def bytes_read(self) -> int:
        return self.store.bytes_read

    @bytes_read.setter
    def bytes_read(self, value: int) -> None:
        self.store.bytes_read = value

    def names(self) -> Iterable[str]:
        return self.store.names()

    def source(self, name: str) -> TensorSource:
        return self.store.source(name)


class OpenFiles:
    """A checkpoint's files, each opened read-only on its first read and closed together (a
    context manager); :attr:`bytes_read` counts the bytes :meth:`pread` returned."""

    def __init__(self) -> None:
        self.bytes_read = 0
        self._fds: dict[Path, int] = {}

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def pread(self, file: Path, offset: int, nbytes: int, name: str) -> bytearray:
        """``nbytes`` of ``file`` from ``offset``; ``CheckpointError`` naming tensor ``name``
        on a short read."""
        if file not in self._fds:
            self._fds[file] = os.open(file, os.O_RDONLY)
        buf = bytearray(nbytes)
        view, got = memoryview(buf), 0
        while got < nbytes:
            n = os.preadv(self._fds[file], [view[got:]], offset + got)
            if n <= 0:
                raise CheckpointError(f"{file}: short read in tensor {name!r}")
            got += n
        self.bytes_read += nbytes
        return buf


class Checkpoint(OpenFiles):
    """All tensors of a checkpoint directory, by name, with lazy sliced reads."""

    def __init__(self, model_dir: str | os.PathLike[str]) -> None:
        super().__init__()
        self.model_dir = Path(model_dir)
        self.entries: dict[str, TensorEntry] = {}
        for file in checkpoint_files(self.model_dir):
            for entry in _read_header(file):
                if entry.name in self.entries:
                    raise CheckpointError(f"tensor {entry.name!r} appears in two shards")
                self.entries[entry.name] = entry

    def names(self) -> Iterator[str]:
        return iter(self.entries)

    def source(self, name: str) -> TensorSource:
        return TensorSource(self.entries[name], self)


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a model directory, checked to exist and agree with the index."""
    index = model_dir / INDEX_NAME
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted({str(f) for f in weight_map.values()})
        except (OSError, KeyError, TypeError, AttributeError, json.JSONDecodeError) as exc:
            raise CheckpointError(f"{index}: corrupt index ({exc!r})") from exc
        paths = [model_dir / f for f in files]
        missing = [str(p.name) for p in paths if not p.is_file()]
        if missing:
            raise CheckpointError(f"{index}: shard files missing: {missing}")
        return paths
    single = model_dir / SINGLE_NAME
    if single.is_file():
        return [single]
    raise CheckpointError(f"{model_dir}: no {SINGLE_NAME} or {INDEX_NAME}")
