"""A stage's decode steps in one backend call, where every layer is plain.

:class:`PlainDecode` asks the backend, at the first decode step, for a whole-step decode of the
stage's layers (``Backend.decode_stack``, :mod:`model_shards.backends.decode_stack`); from then
on a step of decodes only (one KV group, the model's own rotary tables, tensor parallel 1)
runs through it, every other step through the modules. The backend computes what the modules
compute, bit for bit, so which path ran never shows in the output.
"""

from __future__ import annotations

import torch
from torch import nn

from model_shards.backends.decode_stack import DecodeLayerParts, DecodeStack
from model_shards.layers.attention import ForwardBatch
from model_shards.layers.context import ShardContext
from model_shards.layers.mlp import GatedMLP
from model_shards.layers.norm import RMSNorm
from model_shards.layers.rotary_attention import RotaryAttention


def plain_layer_parts(
    input_norm: nn.Module, post_norm: nn.Module, attention: nn.Module, ffn: nn.Module
) -> DecodeLayerParts | None:
    """A pre-norm layer's parts, or ``None`` unless it is plain: RMSNorms of one eps,
    :class:`RotaryAttention` without softcap or its own rotary tables (q/k normalized per head
    by RMSNorms of that eps, or not at all), a SiLU :class:`GatedMLP`, no checkpoint-quantized
    weight."""
    if type(input_norm) is not RMSNorm or type(post_norm) is not RMSNorm:
        return None
    if type(attention) is not RotaryAttention or type(ffn) is not GatedMLP or ffn.act != "silu":
        return None
    core = attention.attn
    if core.softcap is not None or core.rotary is not None or input_norm.eps != post_norm.eps:
        return None
    qk_norms = _head_norms(attention, input_norm.eps)
    if qk_norms is None:
        return None
    linears = (attention.qkv_proj, attention.o_proj, ffn.gate_up_proj, ffn.down_proj)
    qkv, o, gate_up, down = (linear.gemm_parts() for linear in linears)
    if qkv is None or o is None or gate_up is None or down is None:
        return None
    return DecodeLayerParts(
        input_norm.weight,
        post_norm.weight,
        input_norm.eps,
        qkv,
        o,
        gate_up,
        down,
        core.num_heads,
        core.num_kv_heads,
        core.head_dim,
        core.scale,
        *qk_norms,
    )


def _head_norms(
    attention: RotaryAttention, eps: float
) -> tuple[torch.Tensor | None, torch.Tensor | None] | None:
    """The per-head q and k RMSNorm weights (``(None, None)``: no q/k norm), or ``None`` for
    norms the native stack does not take (over the projection, another kind, another eps)."""
    q, k = attention.q_norm, attention.k_norm
    if q is None and k is None:
        return None, None
    if type(q) is not RMSNorm or type(k) is not RMSNorm or q.eps != eps or k.eps != eps:
        return None
    return q.weight, k.weight


class PlainDecode:
    """The whole-step decode of layers ``[start, end)`` of ``layers`` (each with a
    ``decode_parts()``), built at the first decode step; ``None`` from :meth:`run`: the
    modules run this step."""

    def __init__(self, ctx: ShardContext, layers: nn.ModuleList, start: int, end: int):
        self._ops, self._dtype, self._tp = ctx.ops, ctx.dtype, ctx.ps.tp_size
        self._layers, self._range = layers, range(start, end)
        self._stack: DecodeStack | None = None
        self._built = False

    @property
    def active(self) -> bool:
        """Whether decode steps run through the backend's whole-step decode (known after the
        first decode step)."""
        return self._stack is not None

    def run(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor | None:
        """``x [T, H]`` embeddings of a decode-only step → the stage's output ``[T, H]``
        (before the final norm), or ``None``."""
        if batch.prefill is not None or batch.rotary_rows is not None or batch.windows:
            return None
        if batch.decode.window is not None:
            return None
        stack = self._stack_for(batch)
        if stack is None:
            return None
        step = batch.rotary_step(0)
        pools = [batch.kv.pools[i] for i in self._range]
        meta = batch.decode
        return stack(
            x,
            step.positions,
            step.cos_cached,
            step.sin_cached,
            step.slot_mapping,
            meta.block_tables,
            meta.context_lens,
            pools,
        )

    def _stack_for(self, batch: ForwardBatch) -> DecodeStack | None:
        if not self._built:
            self._built = True
            self._stack = self._build(batch)
        return self._stack

    def _build(self, batch: ForwardBatch) -> DecodeStack | None:
        if self._tp != 1 or not self._range:
            return None
        kv = batch.kv
        for i in self._range:
            pool = kv.pools[i]
            if kv.group_of[i] != 0 or pool.k.dtype != self._dtype or pool.v.dtype != self._dtype:
                return None
        parts = []
        for i in self._range:
            decode_parts = getattr(self._layers[i], "decode_parts", None)
            layer_parts = decode_parts() if decode_parts is not None else None
            if layer_parts is None:
                return None
            parts.append(layer_parts)
        return self._ops.decode_stack(parts)
