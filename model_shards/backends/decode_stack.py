"""A whole decode step through a plain decoder stack in one backend call
(:meth:`Backend.decode_stack`): what the stack hands the backend, and what it gets back.

A decode step of a small model at batch 1 is mostly Python between kernels (~45 op calls a
layer through modules, the backend and the dispatcher). A backend that can run the stack's
layers in one native call (the cpu backend: ``backends/cpu/decode_stack.py``) takes their
weights once, as :class:`DecodeLayerParts`, and gives back a :class:`DecodeStack`; it must
compute what the layers' modules compute, bit for bit. "Plain" is Llama's layer (and
Qwen3's): RMSNorm before attention and MLP, fused q/k/v with RoPE (q and k RMS-normalized per
head or not; no softcap or window), a SiLU-gated MLP, tensor parallel 1
(``models/plain_decode.py`` decides which layers are).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from model_shards.quant.weights import QuantizedWeight
from model_shards.worker.kv_cache import KVPool


@dataclass(frozen=True)
class GemmParts:
    """What one linear layer multiplies by: ``quant`` (held quantized) or the dense
    ``weight [out, in]`` with its backend layout ``packed`` (``Backend.pack_linear``);
    ``bias`` inside the GEMM, ``bias_after`` added to its result (a row-parallel layer's)."""

    weight: torch.Tensor
    packed: object | None
    quant: QuantizedWeight | None
    bias: torch.Tensor | None = None
    bias_after: torch.Tensor | None = None


@dataclass(frozen=True)
class DecodeLayerParts:
    """One plain pre-norm layer: ``h = x + o(attn(rope(qkv(norm(x)))))``,
    ``out = h + down(silu(gate(n)) * up(n))``, ``n = post_norm(h)``."""

    input_norm: torch.Tensor  # [H]
    post_norm: torch.Tensor  # [H]
    eps: float
    qkv: GemmParts  # [H] -> [(nh + 2 nkv) D]
    o: GemmParts  # [nh D] -> [H]
    gate_up: GemmParts  # [H] -> [2 I], gate then up
    down: GemmParts  # [I] -> [H]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    q_norm: torch.Tensor | None = None  # [D]: q and k RMS-normalized per head (Qwen3)
    k_norm: torch.Tensor | None = None  # [D]


class DecodeStack(Protocol):
    """A decode step through the layers it was built from."""

    def __call__(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        slot_mapping: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        pools: Sequence[KVPool],
    ) -> torch.Tensor:
        """``x [T, H]`` (one token a sequence; updated in place) → the last layer's output plus
        the residual stream ``[T, H]``; ``positions``, ``slot_mapping``, ``context_lens``
        ``[T]`` int64, ``cos``/``sin`` the rotary tables ``[P, D]``, ``block_tables [T, nblk]``,
        ``pools``: each layer's, in order."""
        ...
