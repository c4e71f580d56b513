"""A layer stack's forward cut at its attention calls, for piecewise CUDA graphs.

A stack of ``L`` :class:`~model_shards.models.stack.DecoderLayer` s whose attention is a
:class:`~model_shards.layers.rotary_attention.RotaryAttention` and whose feed-forward is a
:class:`~model_shards.layers.mlp.GatedMLP` splits into ``L + 1`` pieces around ``L``
attention cores (RoPE, K/V write, paged attention: what reads the step's varlen metadata)::

    piece 0      embed → norm_in(0) → qkv(0)                       → qkv, residual
    attention 0  (eager)                                           → o
    piece k      o_proj(k-1) → norm_post(k-1) → ffn(k-1) → norm_in(k) → qkv(k)
    ...
    piece L      o_proj(L-1) → norm_post(L-1) → ffn(L-1) → + residual → hidden [n, H]
                 (the last stage: the final norm fused with that add, as the stack does)

Pieces read and write only :class:`PieceBuffers` (views of their first ``n`` rows), so one
capture per token count replays with any step's values; rows are independent in every
piece (no attention, no MoE routing), so padded rows never touch real ones.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from model_shards.layers.attention import ForwardBatch
from model_shards.layers.mlp import GatedMLP
from model_shards.layers.rotary_attention import RotaryAttention
from model_shards.models.stack import DecoderLayer, LayerStack


@dataclass(frozen=True)
class PieceBuffers:
    """The tensors pieces hand over, ``max_tokens`` rows each (a piece uses ``[:n]``)."""

    ids: torch.Tensor  # [N] int64 token ids (first stage), else hidden_in [N, H]
    qkv: torch.Tensor  # [N, (nh + 2 nkv) * D] the last piece's projection
    o: torch.Tensor  # [N, nh * D] the eager attention's output
    residual: torch.Tensor  # [N, H]
    out: torch.Tensor  # [N, H] the stack's output (LayerStack.finish)


@dataclass(frozen=True)
class LayerParts:
    layer: DecoderLayer  # its norms
    attn: RotaryAttention
    ffn: GatedMLP


class PiecewiseStack:
    """``stack``'s pieces (:meth:`piece`) and attention cores (:meth:`attention`)."""

    def __init__(self, stack: LayerStack, parts: list[LayerParts]) -> None:
        self.stack, self.parts = stack, parts
        self.num_pieces = len(parts) + 1

    @staticmethod
    def of(stack: LayerStack) -> PiecewiseStack | None:
        """The split, or ``None`` where a layer is not plain enough to cut."""
        parts: list[LayerParts] = []
        for i in range(stack.start, stack.end):
            layer = stack.layers[i]
            if type(layer) is not DecoderLayer or type(layer.self_attn) is not RotaryAttention:
                return None
            ffn = getattr(layer, layer.ffn_name)
            if type(ffn) is not GatedMLP:
                return None
            parts.append(LayerParts(layer, layer.self_attn, ffn))
        return PiecewiseStack(stack, parts) if parts else None

    def buffers(self, max_tokens: int, device: torch.device, dtype: torch.dtype) -> PieceBuffers:
        attn = self.parts[0].attn
        hidden = int(self.parts[0].layer.input_layernorm.weight.shape[0])
        first = self.stack.embed_tokens is not None
        ids_shape = (max_tokens,) if first else (max_tokens, hidden)
        return PieceBuffers(
            ids=torch.zeros(ids_shape, dtype=torch.int64 if first else dtype, device=device),
            qkv=torch.zeros(max_tokens, sum(attn.sizes), dtype=dtype, device=device),
            o=torch.zeros(max_tokens, attn.sizes[0], dtype=dtype, device=device),
            residual=torch.zeros(max_tokens, hidden, dtype=dtype, device=device),
            out=torch.zeros(max_tokens, hidden, dtype=dtype, device=device),
        )

    def piece(self, k: int, n: int, bufs: PieceBuffers) -> torch.Tensor:
        """Piece ``k`` on rows ``[:n]``: ``qkv[:n]`` (``k < L``), else ``out[:n]``."""
        residual: torch.Tensor | None
        if k == 0:
            x, residual = self._embed(bufs.ids[:n]), None  # [n, H]
        else:
            prev = self.parts[k - 1]
            o = prev.attn.o_proj(bufs.o[:n])  # [n, H]
            h, residual = prev.layer.post_attention_layernorm(o, bufs.residual[:n])
            x = prev.ffn(h)  # [n, H]
        if k == len(self.parts):
            return bufs.out[:n].copy_(self.stack.finish(x, residual))
        h, residual = self.parts[k].layer.input_layernorm(x, residual)
        qkv = self.parts[k].attn.qkv_proj(h)  # [n, (nh + 2 nkv) * D]
        bufs.residual[:n].copy_(residual)
        return bufs.qkv[:n].copy_(qkv)

    def attention(self, k: int, bufs: PieceBuffers, batch: ForwardBatch) -> None:
        """Attention core ``k`` on the step's ``T`` real rows: ``qkv[:T]`` → ``o[:T]``."""
        t = batch.num_tokens
        attn = self.parts[k].attn
        bufs.o[:t].copy_(attn.core(bufs.qkv[:t], batch))

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        stack = self.stack
        if stack.embed_tokens is None:
            return ids  # a later stage's hidden rows
        x = stack.embed_tokens(ids)
        return x if stack.embed_scale is None else x * stack.embed_scale
