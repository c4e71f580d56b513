"""Phi-3 decoder (``Phi3ForCausalLM``: Phi-3, Phi-3.5 mini, Phi-4 mini), tensor- and
pipeline-parallel.

Llama's layer (pre-norm RMSNorm, grouped-query attention, SwiGLU MLP, no biases,
``head_dim = hidden_size / num_attention_heads``) with three differences:

* the checkpoint's projections are fused: ``self_attn.qkv_proj.weight`` (rows
  ``[q; k; v]``) and ``mlp.gate_up_proj.weight`` (rows ``[gate; up]``); each rank reads
  only its rows of each part (:mod:`~model_shards.layers.fused_sources`), so
  ``packed_modules_mapping`` maps nothing;
* RoPE may be ``longrope`` (short/long factors and an attention factor on cos and sin,
  the short set below ``original_max_position_embeddings``, see
  :mod:`~model_shards.layers.rotary` for where that differs from transformers: only at
  the positions below it of sequences longer than it);
* ``partial_rotary_factor`` (Phi-4 mini: 0.75) turns only the first
  ``R = int(head_dim * factor)`` dims of each head: q and k heads are stored in
  :func:`~model_shards.layers.rotary.rotary_head_order`'s order, so the backend's
  whole-head rotation is that partial one.

``sliding_window`` is accepted when it cannot matter: ``None`` or at least the served
maximum length (a token attends to the ``sliding_window`` latest positions, itself
included); a smaller one is refused (windows are not supported yet).

As in :mod:`~model_shards.models.llama`, a stage builds only its layers ``[start, end)``
(others are :class:`MissingLayer` placeholders so names match the checkpoint's); the first
stage owns the embedding, the last the final norm and the (possibly tied) LM head.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from model_shards.config import ModelConfig
from model_shards.layers.attention import Attention, ForwardBatch
from model_shards.layers.context import ShardContext
from model_shards.layers.fused_sources import (
    FusedMergedColumnParallelLinear,
    FusedQKVParallelLinear,
)
from model_shards.layers.linear import RowParallelLinear
from model_shards.layers.norm import RMSNorm
from model_shards.layers.rotary import RotaryEmbedding, rotary_head_order
from model_shards.layers.vocab import ParallelLMHead, VocabParallelEmbedding
from model_shards.models.naming import checkpoint_names_of
from model_shards.models.stages import MissingLayer, stage_layer_range


@dataclass(frozen=True)
class Phi3Options:
    """Phi-3's own ``config.json`` fields (beyond :class:`ModelConfig`)."""

    rotary_dim: int  # R: the rotated dims of each head (head_dim * partial_rotary_factor)
    sliding_window: int | None

    @staticmethod
    def parse(cfg: ModelConfig, max_positions: int) -> Phi3Options:
        """Read ``cfg.extra``; ``ValueError`` naming the field when it asks for something not
        supported (an activation other than SiLU, a window shorter than ``max_positions``,
        a partial rotary split with an odd part)."""
        raw = cfg.extra
        act = str(raw.get("hidden_act", "silu"))
        if act != "silu":
            raise ValueError(f"config.json: hidden_act {act!r} not supported for Phi-3 (silu)")
        window = raw.get("sliding_window")
        if window is not None and int(window) < max_positions:
            raise ValueError(
                f"config.json: sliding_window {window} is shorter than the served length "
                f"{max_positions}, and sliding-window attention is not supported yet; serve "
                f"with --max-model-len {window} or less (the window then has no effect)"
            )
        params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        factor = float(params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)))
        rotary_dim = int(cfg.head_dim * factor)
        try:
            rotary_head_order(cfg.head_dim, rotary_dim)
        except ValueError as exc:
            raise ValueError(f"config.json: partial_rotary_factor {factor}: {exc}") from exc
        return Phi3Options(rotary_dim, None if window is None else int(window))


class Phi3Attention(nn.Module):
    """Fused QKV column-parallel → RoPE + K/V write → attention → o row-parallel."""

    def __init__(
        self, cfg: ModelConfig, options: Phi3Options, layer_idx: int, ctx: ShardContext
    ) -> None:
        super().__init__()
        d = cfg.head_dim
        order = rotary_head_order(d, options.rotary_dim) if options.rotary_dim < d else None
        self.qkv_proj = FusedQKVParallelLinear(
            cfg.hidden_size, d, cfg.num_heads, cfg.num_kv_heads, False, ctx, head_order=order
        )
        self.o_proj = RowParallelLinear(cfg.num_heads * d, cfg.hidden_size, False, ctx)
        self.num_heads = self.qkv_proj.num_heads  # per rank
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.attn = Attention(layer_idx, self.num_heads, self.num_kv_heads, d, ctx.ops)

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        qkv = self.qkv_proj(x)  # [T, (nh + 2 nkv) * D], q/k heads in rotary order
        o = self.attn(qkv, batch)  # [T, nh * D]
        return self.o_proj(o)  # [T, H]


class Phi3MLP(nn.Module):
    """``down(silu(gate(x)) * up(x))``: fused gate/up column-parallel, down row-parallel."""

    def __init__(self, cfg: ModelConfig, ctx: ShardContext) -> None:
        super().__init__()
        self.gate_up_proj = FusedMergedColumnParallelLinear(
            cfg.hidden_size, [cfg.intermediate_size] * 2, False, ctx
        )
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, False, ctx)
        self.ops = ctx.ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [T, 2 I / tp]
        return self.down_proj(self.ops.silu_and_mul(gate_up))  # [T, H]


class Phi3DecoderLayer(nn.Module):
    def __init__(
        self, cfg: ModelConfig, options: Phi3Options, layer_idx: int, ctx: ShardContext
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ctx)
        self.self_attn = Phi3Attention(cfg, options, layer_idx, ctx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ctx)
        self.mlp = Phi3MLP(cfg, ctx)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, batch: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x, residual)`` → ``(mlp_out, residual)``: the layer's output is their sum (the
        residual add fused into the following norm; layer 0 gets ``residual=None``)."""
        h, residual = self.input_layernorm(x, residual)
        h, residual = self.post_attention_layernorm(self.self_attn(h, batch), residual)
        return self.mlp(h), residual


class Phi3Model(nn.Module):
    def __init__(
        self, cfg: ModelConfig, options: Phi3Options, ctx: ShardContext, max_positions: int,
        partition: str = "even",
    ) -> None:  # fmt: skip
        super().__init__()
        ps = ctx.ps
        counts = cfg.layer_partition(ps.pp_size, partition)
        self.start, self.end = stage_layer_range(counts, ps.pp_rank)
        self.embed_tokens: VocabParallelEmbedding | None = None
        if ps.is_first_stage:
            self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, ctx)
        self.rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope, options.rotary_dim)
        self.layers = nn.ModuleList(
            Phi3DecoderLayer(cfg, options, i, ctx) if self.start <= i < self.end
            else MissingLayer()
            for i in range(cfg.num_layers)
        )  # fmt: skip
        self.norm: RMSNorm | None = None
        if ps.is_last_stage:
            self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ctx)

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """``x``: token ids ``[T]`` on stage 0, else hidden ``[T, H]``; returns ``[T, H]``."""
        if self.embed_tokens is not None:
            x = self.embed_tokens(x)  # [T, H]
        batch.rotary = self.rotary
        residual: torch.Tensor | None = None
        for i in range(self.start, self.end):
            x, residual = self.layers[i](x, residual, batch)
        return x if residual is None else x + residual


class Phi3ForCausalLM(nn.Module):
    """HF ``Phi3ForCausalLM``: one pipeline stage on one TP rank."""

    # the checkpoint's projections are already fused: names match the parameters'
    packed_modules_mapping: ClassVar[dict[str, tuple[str, str | int]]] = {}
    ignored_suffixes: ClassVar[tuple[str, ...]] = ("rotary_emb.inv_freq",)
    ignored_prefixes: ClassVar[tuple[str, ...]] = ()

    def __init__(
        self, cfg: ModelConfig, ctx: ShardContext, max_positions: int, partition: str = "even"
    ) -> None:
        """``partition``: layers per pipeline stage, see ``ModelConfig.layer_partition``.
        ``ValueError`` naming the ``config.json`` field for what Phi-3 support lacks."""
        super().__init__()
        self.options = Phi3Options.parse(cfg, max_positions)
        self.config = cfg
        self.ps = ctx.ps
        self.model = Phi3Model(cfg, self.options, ctx, max_positions, partition)
        self.lm_head: ParallelLMHead | None = None
        if self.ps.is_last_stage:
            self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, ctx)
            if cfg.tie_word_embeddings and self.model.embed_tokens is not None:
                self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def tied_sources(self) -> dict[str, str]:
        """Parameters read from another checkpoint tensor (tied LM head); a checkpoint
        tensor of that name, if any, is ignored."""
        if self.config.tie_word_embeddings:
            return {"lm_head.weight": "model.embed_tokens.weight"}
        return {}

    def expected_checkpoint_names(self) -> set[str]:
        """Every tensor name the *whole* model (all stages) reads from a checkpoint."""
        first_local = self.model.layers[self.model.start]
        suffixes = checkpoint_names_of(first_local, self.packed_modules_mapping)
        names = {f"model.layers.{i}.{s}" for i in range(self.config.num_layers) for s in suffixes}
        names |= {"model.embed_tokens.weight", "model.norm.weight"}
        if not self.config.tie_word_embeddings:
            names.add("lm_head.weight")
        return names

    def owns(self, name: str) -> bool:
        """Whether this stage holds the checkpoint tensor ``name``."""
        parts = name.split(".")
        if len(parts) > 2 and parts[0] == "model" and parts[1] == "layers":
            return self.model.start <= int(parts[2]) < self.model.end
        if name.startswith("model.embed_tokens."):
            return self.ps.is_first_stage or (self.ps.is_last_stage and bool(self.tied_sources))
        if name.startswith(("model.norm.", "lm_head.")):
            return self.ps.is_last_stage
        return True

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        return self.model(x, batch)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Last stage only: ``hidden [N, H]`` (pre-norm) → ``logits [N, vocab]`` in the model's
        dtype."""
        assert self.model.norm is not None and self.lm_head is not None
        return self.lm_head(self.model.norm(hidden)[0])
