"""The GGML block formats we serve and the holders of quantized weights.

A GGML tensor of type ``t`` stores each row of ``cols`` values as ``cols / block_size(t)``
consecutive blocks of ``type_size(t)`` bytes (block layouts: :mod:`.dequantize`). Rows are
independent, so any row range is a slice of whole rows, and a column range is a slice of
whole blocks when it starts and ends on a block boundary.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum

import torch


class GGMLType(IntEnum):
    """``gguf.GGMLQuantizationType`` values of the types we serve."""

    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    BF16 = 30


# type -> (elements per block, bytes per block), as gguf.GGML_QUANT_SIZES
BLOCK_SIZES: dict[GGMLType, tuple[int, int]] = {
    GGMLType.F32: (1, 4),
    GGMLType.F16: (1, 2),
    GGMLType.BF16: (1, 2),
    GGMLType.Q4_0: (32, 18),
    GGMLType.Q4_1: (32, 20),
    GGMLType.Q5_0: (32, 22),
    GGMLType.Q5_1: (32, 24),
    GGMLType.Q8_0: (32, 34),
    GGMLType.Q4_K: (256, 144),
    GGMLType.Q5_K: (256, 176),
    GGMLType.Q6_K: (256, 210),
}
FLOAT_TYPES = frozenset({GGMLType.F32, GGMLType.F16, GGMLType.BF16})
BLOCK_TYPES = frozenset(BLOCK_SIZES) - FLOAT_TYPES  # the block-quantized ones
# --quantization NAME -> the type layers quantize dense weights to at load
QUANTIZATION_METHODS: dict[str, GGMLType] = {"q8_0": GGMLType.Q8_0, "q4_0": GGMLType.Q4_0}


def ggml_type(value: int) -> GGMLType | None:
    """The served type of a ``gguf.GGMLQuantizationType`` value; ``None``: not one we serve."""
    try:
        return GGMLType(value)
    except ValueError:
        return None


def block_size(qtype: GGMLType) -> int:
    return BLOCK_SIZES[qtype][0]


def row_bytes(qtype: GGMLType, cols: int) -> int:
    """Bytes of one row of ``cols`` values; ``ValueError`` unless whole blocks."""
    elems, nbytes = BLOCK_SIZES[qtype]
    if cols % elems:
        raise ValueError(f"{qtype.name} rows hold multiples of {elems} values, not {cols}")
    return cols // elems * nbytes


@dataclass(frozen=True)
class QuantizedTensor:
    """A ``[rows, cols]`` matrix of one type: ``data`` uint8 ``[rows, row_bytes]``, contiguous."""

    qtype: GGMLType
    data: torch.Tensor
    cols: int

    def __post_init__(self) -> None:
        want = row_bytes(self.qtype, self.cols)
        if self.data.dtype != torch.uint8 or self.data.dim() != 2 or self.data.shape[1] != want:
            raise ValueError(
                f"{self.qtype.name} [*, {self.cols}]: blocks must be uint8 [rows, {want}], "
                f"got {self.data.dtype} {list(self.data.shape)}"
            )

    @property
    def rows(self) -> int:
        return int(self.data.shape[0])

    def dequantize(self) -> torch.Tensor:
        """``[rows, cols]`` float32."""
        from model_shards.quant.dequantize import dequantize

        return dequantize(self.data, self.qtype, self.cols)


@dataclass(frozen=True)
class Segment:
    """Rows ``start .. start + tensor.rows - 1`` of a :class:`QuantizedWeight`."""

    start: int
    tensor: QuantizedTensor

    @property
    def end(self) -> int:
        return self.start + self.tensor.rows


@dataclass
class QuantizedWeight:
    """A layer's ``W [out_features, in_features]`` as row segments, each of one type.

    Fused layers (q/k/v, gate/up) receive their parts separately, possibly of different
    types (a Q4_K_M file mixes Q4_K and Q6_K); adjacent parts of one type are merged into
    one segment. Rows no segment covers (vocab padding) are zero.
    """

    out_features: int
    in_features: int
    segments: list[Segment] = field(default_factory=list)

    def add(self, start: int, tensor: QuantizedTensor) -> None:
        """Hold ``tensor`` as rows ``start ..``; ``ValueError`` on a size or overlap mismatch."""
        end = start + tensor.rows
        if tensor.cols != self.in_features or not 0 <= start <= end <= self.out_features:
            raise ValueError(
                f"rows {start}:{end} x {tensor.cols} do not fit a "
                f"[{self.out_features}, {self.in_features}] weight"
            )
        if any(s.start < end and start < s.end for s in self.segments):
            raise ValueError(f"rows {start}:{end} are loaded twice")
        last = self.segments[-1] if self.segments else None
        if last is not None and last.end == start and last.tensor.qtype == tensor.qtype:
            merged = QuantizedTensor(
                tensor.qtype, torch.cat([last.tensor.data, tensor.data]), tensor.cols
            )
            self.segments[-1] = Segment(last.start, merged)
            return
        self.segments.append(Segment(start, tensor))
        self.segments.sort(key=lambda s: s.start)

    @property
    def covers_all(self) -> bool:
        return sum(s.tensor.rows for s in self.segments) == self.out_features

    @property
    def device(self) -> torch.device:
        return self.segments[0].tensor.data.device if self.segments else torch.device("cpu")

    @property
    def nbytes(self) -> int:
        return sum(s.tensor.data.numel() for s in self.segments)

    def dequantize(self) -> torch.Tensor:
        """``[out_features, in_features]`` float32."""
        out = torch.zeros(self.out_features, self.in_features, device=self.device)
        for s in self.segments:
            out[s.start : s.end] = s.tensor.dequantize()
        return out

    def take_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids [T]`` (int64, in range) dequantized: ``[T, in_features]`` float32."""
        out = torch.zeros(ids.shape[0], self.in_features, device=ids.device)
        for s in self.segments:
            hit = ((ids >= s.start) & (ids < s.end)).nonzero().squeeze(1)  # [t]
            if hit.numel():
                blocks = s.tensor.data.index_select(0, ids[hit] - s.start)
                part = QuantizedTensor(s.tensor.qtype, blocks, s.tensor.cols).dequantize()
                out.index_copy_(0, hit, part)
        return out
