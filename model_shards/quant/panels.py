"""Row panels: GGML blocks of sixteen rows interleaved so that a 512-bit register holds the same
four bytes of all sixteen rows (the CPU backend's ``quant_gemm_panels`` reads them).

A GGML tensor stores row after row, each row block after block. A panel tensor of the same
``[rows, row_bytes]`` bytes (``rows`` a multiple of :data:`PANEL_ROWS`) stores group after
group of sixteen rows, each group block after block, and each block of the sixteen rows as a
*panel block* of ``16 · type_size`` bytes: the block's fields one after another, each field
given for row 0, 1, … 15 in turn. For a Q4_1 block ``[d f16, m f16, qs 16 B]`` that is::

    d[0..15] (32 B) | m[0..15] (32 B) | qs[r][0:4] for r = 0..15 (64 B) | qs[r][4:8] … | …

so one 64-byte load is four quant bytes of each row (a ``vpdpbusd`` operand whose lanes are
the rows), one 32-byte load the rows' sixteen scales. :data:`FIELDS` lists each type's fields
as ``(offset, width)`` in the GGML block; the order is the contract with the kernel
(``backends/cpu/kernels/quant_panels_avx512.h``) and is a pure byte permutation, so
:func:`to_panels` and :func:`from_panels` are exact inverses (Q6_K's and Q4_K's scale bytes
come one byte wide: transposed, one 16-byte load per sub-block).
"""

from __future__ import annotations

from functools import cache

import torch

from model_shards.quant.formats import BLOCK_SIZES, GGMLType

PANEL_ROWS = 16


def _quads(start: int, count: int) -> list[tuple[int, int]]:
    return [(start + 4 * i, 4) for i in range(count)]


# type -> the GGML block's fields in panel order, as (byte offset, width)
FIELDS: dict[GGMLType, list[tuple[int, int]]] = {
    GGMLType.Q4_0: [(0, 2), *_quads(2, 4)],
    GGMLType.Q4_1: [(0, 2), (2, 2), *_quads(4, 4)],
    GGMLType.Q5_0: [(0, 2), (2, 4), *_quads(6, 4)],
    GGMLType.Q5_1: [(0, 2), (2, 2), (4, 4), *_quads(8, 4)],
    GGMLType.Q8_0: [(0, 2), *_quads(2, 8)],
    # d, dmin, the 12 bytes of 6-bit scales one by one, then the 4 chunks of 32 quant bytes
    GGMLType.Q4_K: [(0, 2), (2, 2), *((4 + i, 1) for i in range(12)), *_quads(16, 32)],
    # ... and Q5_K's 32 bytes of fifth bits before the quants
    GGMLType.Q5_K: [
        (0, 2),
        (2, 2),
        *((4 + i, 1) for i in range(12)),
        *_quads(16, 8),
        *_quads(48, 32),
    ],
    # d, the 16 int8 group scales one by one, ql (2 halves x 2 chunks of 32 B), qh (2 x 32 B)
    GGMLType.Q6_K: [(208, 2), *((192 + g, 1) for g in range(16)), *_quads(0, 32), *_quads(128, 16)],
}
PANEL_TYPES = frozenset(FIELDS)


@cache
def _order(qtype: GGMLType) -> tuple[torch.Tensor, torch.Tensor]:
    """``(gather, inverse)`` int64 ``[16 · type_size]``: panel byte i is byte ``gather[i]`` of
    the sixteen GGML blocks laid end to end; ``inverse`` undoes it."""
    size = BLOCK_SIZES[qtype][1]
    fields = FIELDS[qtype]
    if sum(width for _, width in fields) != size:
        raise AssertionError(f"{qtype.name}: panel fields do not cover its {size}-byte block")
    gather = [
        row * size + offset + i
        for offset, width in fields
        for row in range(PANEL_ROWS)
        for i in range(width)
    ]
    forward = torch.tensor(gather, dtype=torch.int64)
    return forward, torch.argsort(forward)


def _check(data: torch.Tensor, qtype: GGMLType) -> tuple[int, int]:
    """``(groups, blocks per row)`` of ``data [rows, row_bytes]``; ``ValueError`` if it has no
    panel layout."""
    if qtype not in PANEL_TYPES:
        raise ValueError(f"{qtype.name} has no row-panel layout")
    rows, width = data.shape
    size = BLOCK_SIZES[qtype][1]
    if rows % PANEL_ROWS or width % size:
        raise ValueError(f"{qtype.name} panels need rows in sixteens, got [{rows}, {width}] bytes")
    return rows // PANEL_ROWS, width // size


def to_panels(data: torch.Tensor, qtype: GGMLType) -> torch.Tensor:
    """GGML blocks ``uint8 [rows, row_bytes]`` → the same bytes as row panels (a new tensor)."""
    groups, blocks = _check(data, qtype)
    size = BLOCK_SIZES[qtype][1]
    gather, _ = _order(qtype)
    grouped = data.reshape(groups, PANEL_ROWS, blocks, size).transpose(1, 2)  # [G, nb, 16, B]
    panels = grouped.reshape(groups, blocks, PANEL_ROWS * size).index_select(2, gather)
    return panels.reshape(data.shape)


def from_panels(data: torch.Tensor, qtype: GGMLType) -> torch.Tensor:
    """Row panels ``uint8 [rows, row_bytes]`` → GGML blocks (a new tensor); any whole groups:
    ``data`` may be a gather of some groups' bytes."""
    groups, blocks = _check(data, qtype)
    size = BLOCK_SIZES[qtype][1]
    _, inverse = _order(qtype)
    panels = data.reshape(groups, blocks, PANEL_ROWS * size).index_select(2, inverse)
    grouped = panels.reshape(groups, blocks, PANEL_ROWS, size).transpose(1, 2)  # [G, 16, nb, B]
    return grouped.reshape(data.shape)


def rows_from_panels(data: torch.Tensor, qtype: GGMLType, rows: torch.Tensor) -> torch.Tensor:
    """GGML blocks ``uint8 [T, row_bytes]`` of ``rows`` (int64 ``[T]``, in range) of the row
    panels ``data``: one gather of exactly their bytes."""
    _, blocks = _check(data, qtype)
    size = BLOCK_SIZES[qtype][1]
    inverse = _order(qtype)[1].to(rows.device).view(PANEL_ROWS, size)  # [16, B]: row's bytes
    group, within = rows // PANEL_ROWS, rows % PANEL_ROWS  # [T]
    block = torch.arange(blocks, device=rows.device) * (PANEL_ROWS * size)  # [nb]
    start = group * (PANEL_ROWS * data.shape[1])  # [T]
    index = start[:, None, None] + block[None, :, None] + inverse[within][:, None, :]
    return data.reshape(-1)[index.reshape(-1)].view(rows.shape[0], data.shape[1])
