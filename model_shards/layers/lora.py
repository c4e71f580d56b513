"""Multi-LoRA: a linear layer's adapters in fixed slots, added to its output row by row.

A layer ``W [out, in]`` with adapters holds ``a [slots, R, in]`` and ``b [slots, out, R]``;
the rows of a step that use slot ``s`` gain ``(x a_s^T) b_s^T`` (the backend's
``add_lora``, one shrink and one expand per slot in use). A fused layer (q/k/v, gate/up) gives
each of its parts its own ``max_rank`` columns of ``R``, so ``b`` is block diagonal: part
``i``'s adapter fills ``a[:, i r : (i + 1) r]`` and the rows of its outputs in ``b``;
``cols [slots, R, 2]`` records which outputs each rank feeds (empty for ranks no adapter
fills), so a backend may skip the zero blocks. A backend with ``lora_b_by_rank`` gets ``b``
stored as ``[slots, R, out]`` (``b`` is then a transposed view).

Tensor parallel, as the weight is split: a column-parallel layer holds ``b``'s rows of its
outputs and the whole ``a``; a row-parallel one holds ``a``'s columns of its inputs and the
whole ``b``, so its product is a partial sum that the layer's all-reduce completes.
"""

from __future__ import annotations

import torch

from model_shards.backends.base import Backend, LoraBatch


class LoraState:
    """The step's rows per adapter slot, shared by every LoRA layer of a rank; the worker sets
    ``batch`` before each forward (``None``: no row uses an adapter)."""

    def __init__(self) -> None:
        self.batch: LoraBatch | None = None


class LoraWeights:
    """One layer's adapter slots: ``a [slots, parts * max_rank, in]``, ``b [slots, out,
    parts * max_rank]`` (this rank's shares, the adapters' scales folded into ``b``)."""

    def __init__(
        self,
        slots: int,
        parts: int,
        max_rank: int,
        shape: tuple[int, int],
        state: LoraState,
        ops: Backend,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        n_in, n_out = shape
        rank = parts * max_rank
        self.max_rank = max_rank
        self.a = torch.zeros(slots, rank, n_in, dtype=dtype, device=device)
        if ops.lora_b_by_rank:
            self.b = torch.zeros(slots, rank, n_out, dtype=dtype, device=device).transpose(1, 2)
        else:
            self.b = torch.zeros(slots, n_out, rank, dtype=dtype, device=device)
        # [slots, R, 2]: rank r of a slot feeds outputs cols[s, r, 0] <= o < cols[s, r, 1]
        self.cols = torch.zeros(slots, rank, 2, dtype=torch.int64, device=device)
        self.state = state
        self.ops = ops

    def clear(self, slot: int) -> None:
        """Slot ``slot`` adds nothing until filled again."""
        self.a[slot].zero_()
        self.b[slot].zero_()
        self.cols[slot].zero_()

    def fill(
        self, slot: int, part: int, a: torch.Tensor, b: torch.Tensor, rows: slice, scale: float
    ) -> None:
        """Part ``part``'s adapter into ``slot``: ``a [r, in]``, ``b [len(rows), r]`` (this
        rank's shares), its outputs at ``rows`` of the layer's."""
        r, lo = a.shape[0], part * self.max_rank
        self.a[slot, lo : lo + r].copy_(a)
        self.b[slot, rows, lo : lo + r].copy_(b * scale)
        first, last, _ = rows.indices(self.b.shape[1])
        self.cols[slot, lo : lo + r, 0] = first
        self.cols[slot, lo : lo + r, 1] = last

    def add(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """``y [T, out] += `` each row's adapter product of ``x [T, in]``, in place."""
        batch = self.state.batch
        if batch is not None and (batch.groups is None or batch.groups):
            self.ops.add_lora(y, x, self.a, self.b, batch, self.cols)
