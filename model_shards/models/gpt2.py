"""GPT-2 (HF ``GPT2LMHeadModel``), tensor- and pipeline-parallel.

Pre-norm blocks with biased LayerNorms, learned absolute positions, no rotary::

    x = wte[ids] + wpe[positions]
    x = x + c_proj(attn(c_attn(ln_1(x))))          # multi-head attention, scale 1/sqrt(D)
    x = x + c_proj(gelu_tanh(c_fc(ln_2(x))))
    logits = ln_f(x) @ wte^T                       # LM head tied to wte (GPT2Config's default)

The checkpoint stores its projections as ``Conv1D`` (``[in, out]``, the transpose of
``nn.Linear``): :mod:`model_shards.layers.conv1d` splits and transposes each rank's
slice (``c_attn``/``c_fc`` by columns, ``c_proj`` by rows). Parameter names are the
checkpoint's (``transformer.h.{i}.…``); a stage builds only its blocks ``[start, end)``,
the first stage the embeddings, the last ``ln_f`` and the LM head.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from model_shards.config.model import ModelConfig
from model_shards.config.rope import RopeConfig
from model_shards.layers.attention import Attention, ForwardBatch
from model_shards.layers.context import ShardContext
from model_shards.layers.conv1d import (
    Conv1DColumnParallelLinear,
    Conv1DQKVParallelLinear,
    Conv1DRowParallelLinear,
)
from model_shards.layers.norm import LayerNorm
from model_shards.layers.rotary import RotaryEmbedding
from model_shards.layers.vocab import ReplicatedEmbedding, VocabParallelEmbedding
from model_shards.models.causal_lm import CausalLM
from model_shards.models.stages import stage_layers

# HF activation name -> F.gelu's ``approximate`` (gelu_new is the tanh formula; F.gelu's
# tanh form equals it up to an ulp in float32)
_GELU_APPROXIMATION = {"gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu": "none"}
# config.json switches transformers honours that this file does not implement
_REFUSED_SWITCHES = (
    "scale_attn_by_inverse_layer_idx",
    "reorder_and_upcast_attn",
    "add_cross_attention",
)


@dataclass(frozen=True)
class GPT2Options:
    """GPT-2's own ``config.json`` fields (the common ones are :class:`ModelConfig`'s)."""

    layer_norm_eps: float  # layer_norm_epsilon
    gelu_approximate: str  # F.gelu's approximate= for activation_function

    @staticmethod
    def from_config(cfg: ModelConfig) -> GPT2Options:
        """Read ``cfg.extra``; ``ValueError`` naming the field this model cannot serve."""
        extra = cfg.extra
        for name in _REFUSED_SWITCHES:
            if extra.get(name):
                raise ValueError(f"config.json: GPT-2 with {name}=true is not supported")
        if not extra.get("scale_attn_weights", True):
            raise ValueError("config.json: GPT-2 with scale_attn_weights=false is not supported")
        activation = str(extra.get("activation_function", "gelu_new"))
        if activation not in _GELU_APPROXIMATION:
            raise ValueError(
                f"config.json: activation_function {activation!r} not supported for GPT-2; "
                f"use one of {sorted(_GELU_APPROXIMATION)}"
            )
        eps = float(extra.get("layer_norm_epsilon", 1e-5))
        return GPT2Options(layer_norm_eps=eps, gelu_approximate=_GELU_APPROXIMATION[activation])


class NoRotary(RotaryEmbedding):
    """Identity rotary tables (``cos = 1``, ``sin = 0``, ``[P, D]`` float32).

    GPT-2 has no rotary embedding, but the backend's ``rotary_and_cache`` is the only op
    that writes K/V into the paged pool; with these tables its rotation
    ``x cos + rotate_half(x) sin`` returns ``x`` exactly in floating point
    (``x * 1 = x``, ``y * 0 = ±0``, ``x + ±0 = x``), so no op of GPT-2's own is needed.
    """

    def __init__(self, head_dim: int, max_positions: int) -> None:
        super().__init__(head_dim, max_positions, RopeConfig())
        self.cos_cached.fill_(1.0)
        self.sin_cached.zero_()


class GPT2Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, ctx: ShardContext) -> None:
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.c_attn = Conv1DQKVParallelLinear(
            h, d, cfg.num_heads, cfg.num_kv_heads, bias=True, ctx=ctx
        )
        self.c_proj = Conv1DRowParallelLinear(cfg.num_heads * d, h, bias=True, ctx=ctx)
        nh, nkv = self.c_attn.num_heads, self.c_attn.num_kv_heads  # per rank
        self.attn = Attention(layer_idx, nh, nkv, d, ctx.ops)  # scale 1/sqrt(D)

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        qkv = self.c_attn(x)  # [T, (nh + 2 nkv) * D]
        o = self.attn(qkv, batch)  # [T, nh * D]
        return self.c_proj(o)  # [T, H]


class GPT2MLP(nn.Module):
    """``c_proj(gelu(c_fc(x)))``: ``c_fc`` column-parallel, ``c_proj`` row-parallel."""

    def __init__(self, cfg: ModelConfig, opts: GPT2Options, ctx: ShardContext) -> None:
        super().__init__()
        self.c_fc = Conv1DColumnParallelLinear(
            cfg.hidden_size, cfg.intermediate_size, bias=True, ctx=ctx
        )
        self.c_proj = Conv1DRowParallelLinear(
            cfg.intermediate_size, cfg.hidden_size, bias=True, ctx=ctx
        )
        self.approximate = opts.gelu_approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.c_fc(x), approximate=self.approximate)  # [T, I / tp]
        return self.c_proj(h)  # [T, H]


class GPT2Block(nn.Module):
    def __init__(
        self, cfg: ModelConfig, opts: GPT2Options, layer_idx: int, ctx: ShardContext
    ) -> None:
        super().__init__()
        self.ln_1 = LayerNorm(cfg.hidden_size, opts.layer_norm_eps, ctx)
        self.attn = GPT2Attention(cfg, layer_idx, ctx)
        self.ln_2 = LayerNorm(cfg.hidden_size, opts.layer_norm_eps, ctx)
        self.mlp = GPT2MLP(cfg, opts, ctx)

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), batch)  # [T, H]
        return x + self.mlp(self.ln_2(x))


class GPT2Model(nn.Module):
    """HF ``GPT2Model`` (``transformer.*``), this stage's part of it."""

    def __init__(
        self,
        cfg: ModelConfig,
        opts: GPT2Options,
        ctx: ShardContext,
        max_positions: int,
        partition: str,
    ) -> None:
        super().__init__()
        ps = ctx.ps

        def block(cfg: ModelConfig, layer_idx: int, ctx: ShardContext) -> GPT2Block:
            return GPT2Block(cfg, opts, layer_idx, ctx)

        self.start, self.end, self.h = stage_layers(cfg, ctx, partition, block)
        self.wte: VocabParallelEmbedding | None = None
        self.wpe: ReplicatedEmbedding | None = None
        if ps.is_first_stage:
            self.wte = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, ctx)
            self.wpe = ReplicatedEmbedding(cfg.max_position_embeddings, cfg.hidden_size, ctx)
        self.rotary = NoRotary(cfg.head_dim, max_positions)
        self.ln_f: LayerNorm | None = None
        if ps.is_last_stage:
            self.ln_f = LayerNorm(cfg.hidden_size, opts.layer_norm_eps, ctx)

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """``x``: token ids ``[T]`` on stage 0, else hidden ``[T, H]``; returns ``[T, H]``
        (before ``ln_f``)."""
        if self.wte is not None and self.wpe is not None:
            x = self.wte(x) + self.wpe(batch.positions)  # [T, H]
        batch.rotary = self.rotary
        for i in range(self.start, self.end):
            x = self.h[i](x, batch)
        return x


class GPT2LMHeadModel(CausalLM):
    """HF ``GPT2LMHeadModel``: one pipeline stage on one TP rank. ``c_attn`` is one
    checkpoint tensor, split by its own loader: nothing is fused by name."""

    layers_prefix = "transformer.h"
    embedding_name = "transformer.wte.weight"
    first_stage_names: ClassVar[tuple[str, ...]] = ("transformer.wpe.weight",)
    last_stage_names: ClassVar[tuple[str, ...]] = (
        "transformer.ln_f.weight",
        "transformer.ln_f.bias",
    )
    # the causal-mask buffers older HF exports saved (leading dot: not c_attn.bias)
    ignored_suffixes: ClassVar[tuple[str, ...]] = (".attn.bias", ".attn.masked_bias")
    # openai-community/gpt2 was saved from GPT2Model: its names lack "transformer." (loader.py)
    base_model_prefix: ClassVar[str] = "transformer"

    def __init__(
        self, cfg: ModelConfig, ctx: ShardContext, max_positions: int, partition: str = "even"
    ) -> None:
        """``partition``: layers per pipeline stage, see ``ModelConfig.layer_partition``.
        ``ValueError`` naming the ``config.json`` field this model cannot serve."""
        super().__init__(cfg, ctx)
        opts = GPT2Options.from_config(cfg)
        self.transformer = GPT2Model(cfg, opts, ctx, max_positions, partition)
        self.lm_head = self.build_lm_head(ctx, self.transformer.wte)

    @staticmethod
    def check_config(cfg: ModelConfig, max_model_len: int) -> None:
        """``ValueError`` naming the ``config.json`` field this model cannot serve
        (:meth:`GPT2Options.from_config`); the parent calls it before spawning."""
        GPT2Options.from_config(cfg)

    @property
    def model(self) -> GPT2Model:
        """The layer stack (the DecoderModel protocol's name for ``transformer``)."""
        return self.transformer

    def stage_layers(self) -> range:
        return range(self.transformer.start, self.transformer.end)

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        return self.transformer(x, batch)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Last stage only: ``hidden [N, H]`` (before ``ln_f``) → ``logits [N, vocab]`` in
        the model's dtype."""
        assert self.transformer.ln_f is not None and self.lm_head is not None
        return self.lm_head(self.transformer.ln_f(hidden))
