"""The holders of quantized weights: one type's blocks, and a layer's weight as row segments.

A :class:`QuantizedTensor` stores each row of ``cols`` values as whole blocks of its type
(:mod:`.formats`), so a row range is a slice of rows and a column range on block boundaries a
slice of bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from model_shards.quant.dequantize import dequantize
from model_shards.quant.formats import GGMLType, row_bytes


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
        self.segments.append(Segment(start, tensor))
        self.segments.sort(key=lambda s: s.start)
        self._merge_adjacent()

    def _merge_adjacent(self) -> None:
        """Join each run of touching segments of one type into one (whatever order the parts
        arrived in: a GGUF file lists ``attn_k`` before ``attn_q``), so that a fused layer of
        one type is one GEMM."""
        merged: list[Segment] = []
        for s in self.segments:
            last = merged[-1] if merged else None
            if last is not None and last.end == s.start and last.tensor.qtype == s.tensor.qtype:
                data = torch.cat([last.tensor.data, s.tensor.data])
                merged[-1] = Segment(
                    last.start, QuantizedTensor(s.tensor.qtype, data, s.tensor.cols)
                )
            else:
                merged.append(s)
        self.segments = merged

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
