"""The routed experts of a quantized checkpoint (AWQ, GPTQ, compressed-tensors W4A16 / FP8),
held as the checkpoint stores them while they load, then in the backend's form.

Each local expert's ``w13 [2 I_l, H]`` (gate rows, then up rows) and ``w2 [H, I_l]`` is a
:class:`~model_shards.quant.checkpoint_weight.CheckpointWeight`. After loading,
:meth:`ExpertHolders.backend_forms` asks the backend for each matrix's form
(``Backend.prepare_checkpoint_weight``): when every one is GGML blocks (the ``cpu`` backend's
Q4_0 / Q4_1 for 4-bit groups of 32), the experts stay quantized and ``fused_moe`` runs them
through ``quantized_linear`` (``ExpertWeights.packed13/packed2`` hold the blocks); otherwise
(FP8 on CPU, act-order groups, the reference and ``cuda`` backends: their experts op takes
dense matrices) :meth:`ExpertHolders.dequantize_into` fills the stacked dense parameters.
"""

from __future__ import annotations

import torch

from model_shards.backends.base import Backend
from model_shards.quant.checkpoint_weight import CheckpointPart, CheckpointWeight
from model_shards.quant.weights import QuantizedWeight

Forms = tuple[tuple[QuantizedWeight, ...], tuple[QuantizedWeight, ...]]


class ExpertHolders:
    """``num_local`` experts' ``w13 [2 i_local, hidden]`` and ``w2 [hidden, i_local]``, held
    quantized part by part (:meth:`hold`)."""

    def __init__(self, num_local: int, i_local: int, hidden: int) -> None:
        self.w13 = [CheckpointWeight(2 * i_local, hidden) for _ in range(num_local)]
        self.w2 = [CheckpointWeight(hidden, i_local) for _ in range(num_local)]

    def hold(self, role: str, local: int, part: CheckpointPart) -> None:
        """Expert ``local``'s ``gate``, ``up`` (rows of ``w13``) or ``down`` (``w2``) part;
        ``ValueError`` on a size mismatch."""
        if role == "down":
            self.w2[local].add(0, part)
        else:
            held = self.w13[local]
            held.add(0 if role == "gate" else held.out_features // 2, part)

    @property
    def complete(self) -> bool:
        """Whether every matrix of every expert arrived quantized."""
        return all(w.covers_all for w in (*self.w13, *self.w2))

    def backend_forms(self, ops: Backend, dtype: torch.dtype) -> Forms | None:
        """Every matrix as GGML blocks (``ops``' form of it), or ``None`` when any is not."""
        if not self.complete:
            return None
        forms = [ops.prepare_checkpoint_weight(w, dtype) for w in (*self.w13, *self.w2)]
        blocks = [f for f in forms if isinstance(f, QuantizedWeight)]
        if len(blocks) != len(forms):
            return None
        n = len(self.w13)
        return tuple(blocks[:n]), tuple(blocks[n:])

    def dequantize_into(self, w13: torch.Tensor, w2: torch.Tensor) -> None:
        """The held parts into the stacked ``w13 [E_l, 2 I_l, H]`` and ``w2 [E_l, H, I_l]``
        (rows no part holds: left as they are, loaded dense)."""
        for stacked, held in ((w13, self.w13), (w2, self.w2)):
            for local, weight in enumerate(held):
                for start, part in weight.parts:
                    rows = stacked[local].narrow(0, start, part.out_features)
                    rows.copy_(part.dequantize().to(stacked.dtype))
