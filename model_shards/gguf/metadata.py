"""A GGUF file's metadata (its key/value section) in full, read without touching tensors.

:func:`read_gguf_metadata` parses the header and key/value pairs (GGUF v2/v3, little-endian)
of one file (a split checkpoint's first shard holds them: ``files.gguf_files(path)[0]``) and
stops before the tensor table: strings are ``str``, numeric and string arrays are lists,
``bool`` is ``bool``. The tokenizer (``model_shards/gguf/tokenizer.py``) needs the long arrays
(vocabulary, merges) that :mod:`.reader` leaves out.

Parsing is plain ``struct`` over a memory map: a 49k-token vocabulary with its merges reads
in about 0.1 s (``gguf.GGUFReader`` builds numpy views of every string, ~20x slower). A file
that is not GGUF, is cut short or holds an unknown value type raises ``ValueError`` naming it.
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path
from typing import Any

import numpy as np

GGUF_MAGIC = b"GGUF"

_SCALARS: dict[int, str] = {  # GGUF value type -> struct format (little-endian)
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
_NUMPY: dict[int, str] = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4"}
_NUMPY.update({7: "?", 10: "<u8", 11: "<i8", 12: "<f8"})
_STRING = 8
_ARRAY = 9


class _Cursor:
    """Little-endian reads from a buffer; ``ValueError`` past its end."""

    def __init__(self, buffer: mmap.mmap, path: Path) -> None:
        self.buffer = buffer
        self.pos = 0
        self.path = path

    def unpack(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.buffer):
            raise ValueError(f"{self.path}: GGUF metadata cut short")
        (value,) = struct.unpack_from(fmt, self.buffer, self.pos)
        self.pos += size
        return value

    def string(self) -> str:
        size = self.unpack("<Q")
        end = self.pos + size
        if end > len(self.buffer):
            raise ValueError(f"{self.path}: GGUF metadata cut short")
        text = self.buffer[self.pos : end].decode("utf-8", errors="replace")
        self.pos = end
        return text

    def value(self, kind: int) -> Any:
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            return self.array()
        fmt = _SCALARS.get(kind)
        if fmt is None:
            raise ValueError(f"{self.path}: unknown GGUF value type {kind}")
        return self.unpack(fmt)

    def array(self) -> list[Any]:
        kind = self.unpack("<I")
        count = self.unpack("<Q")
        dtype = _NUMPY.get(kind)
        if dtype is not None:
            values = np.frombuffer(self.buffer, dtype=dtype, count=count, offset=self.pos)
            self.pos += values.nbytes
            return list(values.tolist())
        return [self.value(kind) for _ in range(count)]


def read_gguf_metadata(path: str | Path) -> dict[str, Any]:
    """Every metadata key of the GGUF file ``path`` and its value (tensor data untouched)."""
    path = Path(path)
    try:
        with path.open("rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            return _parse(_Cursor(mm, path))
    except (OSError, ValueError) as exc:  # mmap of an empty file raises ValueError too
        if isinstance(exc, ValueError) and str(exc).startswith(str(path)):
            raise
        raise ValueError(f"{path}: cannot read GGUF metadata ({exc})") from exc


def _parse(cursor: _Cursor) -> dict[str, Any]:
    if cursor.buffer[:4] != GGUF_MAGIC:
        raise ValueError(f"{cursor.path}: not a GGUF file (no GGUF magic)")
    cursor.pos = 4
    version = cursor.unpack("<I")
    if version not in (2, 3):
        raise ValueError(f"{cursor.path}: GGUF version {version} is not supported (2 or 3)")
    cursor.unpack("<Q")  # tensor count
    kv_count = cursor.unpack("<Q")
    metadata: dict[str, Any] = {}
    for _ in range(kv_count):
        key = cursor.string()
        metadata[key] = cursor.value(cursor.unpack("<I"))
    return metadata
