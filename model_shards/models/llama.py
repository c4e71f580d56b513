"""Llama-family decoder (Llama, Mistral, Qwen2), tensor- and pipeline-parallel.

Reads like the Hugging Face model; sharding lives in the layers. A stage builds
only its layers ``[start, end)``; others are :class:`MissingLayer` placeholders
so parameter names still match the checkpoint's (``model.layers.{i}.…``).
The first stage owns the embedding, the last the final norm and LM head.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from model_shards.config import ModelConfig
from model_shards.layers.attention import Attention, ForwardBatch
from model_shards.layers.context import ShardContext
from model_shards.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from model_shards.layers.norm import RMSNorm
from model_shards.layers.rotary import RotaryEmbedding
from model_shards.layers.vocab import ParallelLMHead, VocabParallelEmbedding
from model_shards.models.naming import checkpoint_names_of
from model_shards.models.stages import MissingLayer, stage_layer_range


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, ctx: ShardContext) -> None:
        super().__init__()
        self.qkv_proj = QKVParallelLinear(
            cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, cfg.attention_bias,
            ctx,
        )  # fmt: skip
        self.o_proj = RowParallelLinear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, False, ctx)
        self.num_heads = self.qkv_proj.num_heads  # per rank
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.head_dim = cfg.head_dim
        self.attn = Attention(layer_idx, self.num_heads, self.num_kv_heads, cfg.head_dim, ctx.ops)

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        qkv = self.qkv_proj(x)  # [T, (nh + 2 nkv) * D]
        o = self.attn(qkv, batch)  # [T, nh * D]
        return self.o_proj(o)  # [T, H]


class LlamaMLP(nn.Module):
    """``down(silu(gate(x)) * up(x))``: gate/up column-parallel (fused), down row-parallel."""

    def __init__(self, cfg: ModelConfig, ctx: ShardContext) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            cfg.hidden_size, [cfg.intermediate_size] * 2, False, ctx
        )
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, False, ctx)
        self.ops = ctx.ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [T, 2 I / tp]
        return self.down_proj(self.ops.silu_and_mul(gate_up))  # [T, H]


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, ctx: ShardContext) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ctx)
        self.self_attn = LlamaAttention(cfg, layer_idx, ctx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ctx)
        self.mlp = LlamaMLP(cfg, ctx)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, batch: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x, residual)`` → ``(mlp_out, residual)``: the layer's output is their sum.

        The residual add is fused into the following norm (vLLM's layout); layer 0
        gets ``residual=None``.
        """
        h, residual = self.input_layernorm(x, residual)
        h, residual = self.post_attention_layernorm(self.self_attn(h, batch), residual)
        return self.mlp(h), residual


class LlamaModel(nn.Module):
    def __init__(
        self, cfg: ModelConfig, ctx: ShardContext, max_positions: int, partition: str = "even"
    ) -> None:
        super().__init__()
        ps = ctx.ps
        counts = cfg.layer_partition(ps.pp_size, partition)
        self.start, self.end = stage_layer_range(counts, ps.pp_rank)
        self.ps = ps
        self.embed_tokens: VocabParallelEmbedding | None = None
        if ps.is_first_stage:
            self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, ctx)
        self.rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(cfg, i, ctx) if self.start <= i < self.end
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


class LlamaForCausalLM(nn.Module):
    """HF ``LlamaForCausalLM`` / ``MistralForCausalLM`` / ``Qwen2ForCausalLM``."""

    # checkpoint name part -> (fused parameter part, shard id)
    packed_modules_mapping: ClassVar[dict[str, tuple[str, str | int]]] = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    # checkpoint tensors that carry no weights (older HF exports)
    ignored_suffixes: ClassVar[tuple[str, ...]] = ("rotary_emb.inv_freq",)
    ignored_prefixes: ClassVar[tuple[str, ...]] = ()

    def __init__(
        self, cfg: ModelConfig, ctx: ShardContext, max_positions: int, partition: str = "even"
    ) -> None:
        """``partition``: layers per pipeline stage, see ``ModelConfig.layer_partition``."""
        super().__init__()
        self.config = cfg
        self.ps = ctx.ps
        self.model = LlamaModel(cfg, ctx, max_positions, partition)
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

    def layer_index(self, name: str) -> int | None:
        """The decoder layer a checkpoint name belongs to, or ``None``."""
        parts = name.split(".")
        if len(parts) > 2 and parts[0] == "model" and parts[1] == "layers":
            return int(parts[2])
        return None

    def owns(self, name: str) -> bool:
        """Whether this stage holds the checkpoint tensor ``name``."""
        layer = self.layer_index(name)
        if layer is not None:
            return self.model.start <= layer < self.model.end
        if name.startswith("model.embed_tokens."):
            return self.ps.is_first_stage or (self.ps.is_last_stage and bool(self.tied_sources))
        if name.startswith(("model.norm.", "lm_head.")):
            return self.ps.is_last_stage
        return True

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        return self.model(x, batch)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Last stage only: ``hidden [N, H]`` (pre-norm) → ``logits [N, vocab]`` in the model's
        dtype (the sampler widens them to float32 only where a row needs more than argmax)."""
        assert self.model.norm is not None and self.lm_head is not None
        return self.lm_head(self.model.norm(hidden)[0])
