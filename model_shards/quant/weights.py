"""The holders of quantized weights: one type's blocks, and a layer's weight as row segments.

A :class:`QuantizedTensor` stores each row of ``cols`` values as whole blocks of its type
(:mod:`.formats`), so a row range is a slice of rows and a column range on block boundaries a
slice of bytes; or, once a backend asked for it after loading (:meth:`QuantizedWeight.to_panels`),
the same bytes as row panels (:mod:`.panels`), which only that backend's GEMM reads directly.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from model_shards.quant.dequantize import dequantize
from model_shards.quant.formats import GGMLType, row_bytes
from model_shards.quant.panels import (
    PANEL_ROWS,
    PANEL_TYPES,
    from_panels,
    rows_from_panels,
    to_panels,
)


@dataclass(frozen=True)
class QuantizedTensor:
    """A ``[rows, cols]`` matrix of one type: ``data`` uint8 ``[rows, row_bytes]``, contiguous;
    GGML blocks row after row, or row panels (``panels``: :mod:`.panels`, rows in sixteens)."""

    qtype: GGMLType
    data: torch.Tensor
    cols: int
    panels: bool = False

    def __post_init__(self) -> None:
        want = row_bytes(self.qtype, self.cols)
        if self.data.dtype != torch.uint8 or self.data.dim() != 2 or self.data.shape[1] != want:
            raise ValueError(
                f"{self.qtype.name} [*, {self.cols}]: blocks must be uint8 [rows, {want}], "
                f"got {self.data.dtype} {list(self.data.shape)}"
            )
        if self.panels and (self.qtype not in PANEL_TYPES or self.rows % PANEL_ROWS):
            raise ValueError(f"{self.qtype.name} x {self.rows} rows has no row-panel layout")

    @property
    def rows(self) -> int:
        return int(self.data.shape[0])

    def as_panels(self) -> QuantizedTensor:
        """The same matrix as row panels (a new tensor; ``self`` if it already is)."""
        if self.panels:
            return self
        return QuantizedTensor(self.qtype, to_panels(self.data, self.qtype), self.cols, True)

    def blocks(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """GGML blocks ``uint8 [len(rows), row_bytes]`` of ``rows`` (int64, in range; all rows
        if ``None``), whatever the layout."""
        if not self.panels:
            return self.data if rows is None else self.data.index_select(0, rows)
        if rows is None:
            return from_panels(self.data, self.qtype)
        return rows_from_panels(self.data, self.qtype, rows)

    def dequantize(self) -> torch.Tensor:
        """``[rows, cols]`` float32."""
        return dequantize(self.blocks(), self.qtype, self.cols)


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
            if (
                last is not None
                and last.end == s.start
                and last.tensor.qtype == s.tensor.qtype
                and not (last.tensor.panels or s.tensor.panels)
            ):
                data = torch.cat([last.tensor.data, s.tensor.data])
                merged[-1] = Segment(
                    last.start, QuantizedTensor(s.tensor.qtype, data, s.tensor.cols)
                )
            else:
                merged.append(s)
        self.segments = merged

    def permute_rows(self, order: torch.Tensor) -> None:
        """Row ``i`` becomes row ``order[i]`` (int64 ``[r]``, r <= out_features; rows from r
        on stay), in place; each segment's rows must come from the same segment (a
        permutation within heads, say), else ``ValueError``."""
        rows = order.shape[0]
        full = torch.cat([order, torch.arange(rows, self.out_features)])
        for i, s in enumerate(self.segments):
            local = full[s.start : s.end] - s.start  # [rows of s]
            if local.numel() and (local.min() < 0 or local.max() >= s.tensor.rows):
                raise ValueError(f"a row order moves rows across segment {s.start}:{s.end}")
            t = s.tensor
            data = t.blocks().index_select(0, local)
            self.segments[i] = Segment(s.start, QuantizedTensor(t.qtype, data, t.cols))

    def to_panels(self, types: frozenset[GGMLType]) -> bool:
        """Lay out each segment of one of ``types`` as row panels, in place (the GGML bytes are
        let go): its rows in sixteens, a last few rows staying a GGML segment of their own;
        ``True`` if any was."""
        laid: list[Segment] = []
        for s in self.segments:
            t, whole = s.tensor, s.tensor.rows - s.tensor.rows % PANEL_ROWS
            if t.panels or t.qtype not in types or t.qtype not in PANEL_TYPES or whole == 0:
                laid.append(s)
                continue
            head = QuantizedTensor(t.qtype, t.data[:whole], t.cols).as_panels()
            laid.append(Segment(s.start, head))
            if whole < t.rows:
                tail = QuantizedTensor(t.qtype, t.data[whole:].clone(), t.cols)
                laid.append(Segment(s.start + whole, tail))
        changed = len(laid) != len(self.segments) or any(
            a is not b for a, b in zip(laid, self.segments, strict=True)
        )
        self.segments = laid
        return changed

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
                blocks = s.tensor.blocks(ids[hit] - s.start)
                part = QuantizedTensor(s.tensor.qtype, blocks, s.tensor.cols).dequantize()
                out.index_copy_(0, hit, part)
        return out
