"""The rotary self-attention block of a decoder layer: q/k/v projection, optional q/k norms,
RoPE with the K/V write, paged attention, o projection.

A family says how its attention differs in data (:class:`AttentionOptions`), not in a
subclass. Parameter names are the checkpoint's: ``qkv_proj`` (filled from ``q_proj``,
``k_proj`` and ``v_proj`` through the model's ``packed_modules_mapping``, or from one
fused tensor), ``o_proj``, ``q_norm`` and ``k_norm``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from model_shards.backends.base import HeadNorms
from model_shards.config.model import ModelConfig
from model_shards.layers.attention import Attention, ForwardBatch
from model_shards.layers.context import ShardContext
from model_shards.layers.fused_sources import FusedQKVParallelLinear
from model_shards.layers.linear import QKVParallelLinear, RowParallelLinear
from model_shards.layers.norm import RMSNorm
from model_shards.layers.rotary import RotaryEmbedding, rotary_head_order
from model_shards.layers.sharded_norm import ShardedRMSNorm


@dataclass(frozen=True)
class QKNorm:
    """RMSNorm of q and k before RoPE (eps ``rms_norm_eps``). ``"head"``: every head on its
    own, weights ``[D]`` shared by all heads (Qwen3, Gemma 3); ``"projection"``: one
    statistic over all heads of the projection, summed across the TP group (OLMo 2)."""

    over: Literal["head", "projection"]
    norm: type[RMSNorm] = RMSNorm  # a per-head norm's class (Gemma's ``1 + w``)


@dataclass(frozen=True)
class AttentionOptions:
    """What a family changes in :class:`RotaryAttention`; the defaults are plain Llama's."""

    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: QKNorm | None = None
    scale: float | None = None  # of the scores; None: head_dim ** -0.5
    softcap: float | None = None  # scores squashed to softcap * tanh(s / softcap) (Gemma 2)
    fused_checkpoint: bool = False  # q/k/v are one checkpoint tensor, ``qkv_proj`` (Phi-3)
    # partial RoPE (needs fused_checkpoint): only the first R dims of each q/k head turn;
    # the heads are loaded in rotary_head_order, so the backend's whole-head rotation is that
    rotary_dim: int | None = None


class RotaryAttention(nn.Module):
    """``x [T, H]`` → ``[T, H]``: QKV column-parallel (this rank's ``nh`` query and ``nkv``
    key/value heads) → q/k norms → RoPE and K/V write → paged attention → o row-parallel
    (one all-reduce). ``rotary``: this layer's own RoPE tables, else the model's."""

    def __init__(
        self,
        cfg: ModelConfig,
        layer_idx: int,
        ctx: ShardContext,
        options: AttentionOptions,
        rotary: RotaryEmbedding | None = None,
    ) -> None:
        super().__init__()
        d = cfg.head_dim
        self.qkv_proj = _qkv_projection(cfg, ctx, options)
        self.o_proj = RowParallelLinear(
            cfg.num_heads * d, cfg.hidden_size, bias=options.o_bias, ctx=ctx
        )
        nh, nkv = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads  # per rank
        self.attn = Attention(
            layer_idx,
            nh,
            nkv,
            d,
            ctx.ops,
            scale=options.scale,
            softcap=options.softcap,
            rotary=rotary,
        )
        self.head_dim = d
        self.sizes = [nh * d, nkv * d, nkv * d]
        self.q_norm: RMSNorm | ShardedRMSNorm | None = None
        self.k_norm: RMSNorm | ShardedRMSNorm | None = None
        qk = options.qk_norm
        if qk is not None and qk.over == "head":
            self.q_norm = qk.norm(d, cfg.rms_norm_eps, ctx)
            self.k_norm = qk.norm(d, cfg.rms_norm_eps, ctx)
        elif qk is not None:
            self.q_norm = ShardedRMSNorm(cfg.num_heads, d, cfg.rms_norm_eps, ctx)
            self.k_norm = ShardedRMSNorm(cfg.num_kv_heads, d, cfg.rms_norm_eps, ctx)

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        qkv = self.qkv_proj(x)  # [T, (nh + 2 nkv) * D]
        o = self.core(qkv, batch)  # [T, nh * D]
        return self.o_proj(o)  # [T, H]

    def core(self, qkv: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """What reads the step's attention metadata: ``qkv [T, (nh + 2 nkv) * D]`` → q/k
        norms, RoPE and K/V write, paged attention → ``[T, nh * D]``. Per-head RMSNorms go
        to the backend with the RoPE (one fused kernel on CUDA); others run here."""
        norms = self._head_norms()
        if norms is None:
            # views of qkv: [T, nh * D], [T, nkv * D], [T, nkv * D]; the backend's RoPE and
            # K/V write read all three from qkv, so q and k are normalised in place
            q, k, _v = qkv.split(self.sizes, dim=-1)
            self._normalize(self.q_norm, q)
            self._normalize(self.k_norm, k)
        return self.attn(qkv, batch, norms)

    def _head_norms(self) -> HeadNorms | None:
        """The q/k norms as the backend takes them: per-head RMSNorms (Gemma's ``1 + w``
        is its loaded weight) of one eps; ``None`` otherwise."""
        q, k = self.q_norm, self.k_norm
        if not isinstance(q, RMSNorm) or not isinstance(k, RMSNorm) or q.eps != k.eps:
            return None
        if type(q).forward is not RMSNorm.forward or type(k).forward is not RMSNorm.forward:
            return None  # a subclass computing something else
        return HeadNorms(q.weight, k.weight, q.eps)

    def _normalize(self, norm: RMSNorm | ShardedRMSNorm | None, x: torch.Tensor) -> None:
        """``x [T, heads * D]`` (a view into qkv) normalised in place by ``norm``."""
        if isinstance(norm, ShardedRMSNorm):  # one statistic per token, across the TP group
            x.copy_(norm(x))
        elif norm is not None:  # each head on its own: rows [T * heads, D]
            x.copy_(norm(x.reshape(-1, self.head_dim))[0].view_as(x))


def _qkv_projection(
    cfg: ModelConfig, ctx: ShardContext, options: AttentionOptions
) -> QKVParallelLinear:
    sizes = (cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads)
    if not options.fused_checkpoint:
        if options.rotary_dim is not None:
            raise ValueError("partial rotary (rotary_dim) needs a fused q/k/v checkpoint")
        return QKVParallelLinear(*sizes, bias=options.qkv_bias, ctx=ctx)
    d, r = cfg.head_dim, options.rotary_dim or cfg.head_dim
    order = rotary_head_order(d, r) if r < d else None
    return FusedQKVParallelLinear(*sizes, bias=options.qkv_bias, ctx=ctx, head_order=order)
