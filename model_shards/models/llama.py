"""Llama-family decoder (Llama, Mistral, Qwen2), tensor- and pipeline-parallel.

Reads like the Hugging Face model; sharding lives in the layers. A stage builds
only its layers ``[start, end)``; others are :class:`MissingLayer` placeholders
so parameter names still match the checkpoint's (``model.layers.{i}.…``).
The first stage owns the embedding, the last the final norm and LM head.

Qwen3, Phi-3 and OLMo 2 keep this stack and its checkpoint names and change the layer:
their classes subclass :class:`LlamaForCausalLM` and set ``decoder_layer`` (and, where
they differ, the rotary tables and the ``config.json`` checks).
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from model_shards.config.kv_layout import WINDOWED_ARCHITECTURES
from model_shards.config.model import ModelConfig
from model_shards.layers.attention import Attention, ForwardBatch
from model_shards.layers.context import ShardContext
from model_shards.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from model_shards.layers.norm import RMSNorm
from model_shards.layers.rotary import RotaryEmbedding
from model_shards.layers.vocab import VocabParallelEmbedding
from model_shards.models.causal_lm import CausalLM
from model_shards.models.stages import LayerFactory, stage_layers

# Qwen2's language models: q/k/v biased, o not
_NO_O_BIAS = ("Qwen2ForCausalLM", "Qwen2_5_VLForConditionalGeneration")


class LlamaAttention(nn.Module):
    """QKV column-parallel → RoPE + K/V write → attention → o row-parallel.

    q/k/v carry a bias when ``attention_bias`` says so, and so does o, except in Qwen2
    and Qwen2.5-VL (whose configs force the q/k/v bias; its o has none)."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, ctx: ShardContext) -> None:
        super().__init__()
        self.qkv_proj = QKVParallelLinear(
            cfg.hidden_size,
            cfg.head_dim,
            cfg.num_heads,
            cfg.num_kv_heads,
            bias=cfg.attention_bias,
            ctx=ctx,
        )
        o_bias = cfg.attention_bias and cfg.architecture not in _NO_O_BIAS
        self.o_proj = RowParallelLinear(
            cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=o_bias, ctx=ctx
        )
        self.num_heads = self.qkv_proj.num_heads  # per rank
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.head_dim = cfg.head_dim
        self.attn = Attention(layer_idx, self.num_heads, self.num_kv_heads, cfg.head_dim, ctx.ops)

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        qkv = self.qkv_proj(x)  # [T, (nh + 2 nkv) * D]
        o = self.attn(qkv, batch)  # [T, nh * D]
        return self.o_proj(o)  # [T, H]


class LlamaMLP(nn.Module):
    """``down(silu(gate(x)) * up(x))``: gate/up column-parallel (fused), down row-parallel.
    ``gate_up_class``: how gate/up are read from the checkpoint (two tensors here)."""

    gate_up_class: ClassVar[type[MergedColumnParallelLinear]] = MergedColumnParallelLinear

    def __init__(self, cfg: ModelConfig, ctx: ShardContext) -> None:
        super().__init__()
        self.gate_up_proj = self.gate_up_class(
            cfg.hidden_size, [cfg.intermediate_size] * 2, bias=False, ctx=ctx
        )
        self.down_proj = RowParallelLinear(
            cfg.intermediate_size, cfg.hidden_size, bias=False, ctx=ctx
        )
        self.ops = ctx.ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [T, 2 I / tp]
        return self.down_proj(self.ops.silu_and_mul(gate_up))  # [T, H]


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block: ``h = x + attn(norm(x))``, ``out = h + mlp(norm(h))``. A family that
    changes only the attention or the MLP subclasses it and sets the class here."""

    attention_class: ClassVar[LayerFactory] = LlamaAttention
    mlp_class: ClassVar[type[LlamaMLP]] = LlamaMLP

    def __init__(self, cfg: ModelConfig, layer_idx: int, ctx: ShardContext) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ctx)
        self.self_attn = self.attention_class(cfg, layer_idx, ctx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ctx)
        self.mlp = self.mlp_class(cfg, ctx)

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
    """This stage's layers ``[start, end)`` of ``layer`` (any ``(x, residual, batch) ->
    (x, residual)`` module; a layer that adds its own residual returns ``(out, None)``),
    the embedding on the first stage, the final norm on the last; ``rotary``: the tables
    every layer's attention reads from the batch. ``norm_class``: the final norm's (Gemma:
    ``(1 + w)``); ``embed_scale``: what the embeddings are multiplied by (Gemma: sqrt(H),
    rounded to the dtype), ``None`` for nothing."""

    def __init__(
        self,
        cfg: ModelConfig,
        ctx: ShardContext,
        layer: LayerFactory,
        rotary: RotaryEmbedding,
        partition: str = "even",
        *,
        norm_class: type[RMSNorm] = RMSNorm,
        embed_scale: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        ps = ctx.ps
        self.start, self.end, self.layers = stage_layers(cfg, ctx, partition, layer)
        self.embed_tokens: VocabParallelEmbedding | None = None
        if ps.is_first_stage:
            self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, ctx)
        self.rotary = rotary
        self.norm: RMSNorm | None = None
        if ps.is_last_stage:
            self.norm = norm_class(cfg.hidden_size, cfg.rms_norm_eps, ctx)
        self.embed_scale = embed_scale

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """``x``: token ids ``[T]`` on stage 0, else hidden ``[T, H]``; returns ``[T, H]``.
        Stage 0 also takes input embeddings ``[T, H]`` (a vision-language model's, images
        already scattered in: ``models/llava.py``)."""
        if self.embed_tokens is not None and not x.is_floating_point():
            x = self.embed_tokens(x)  # [T, H]
            if self.embed_scale is not None:
                x = x * self.embed_scale
        batch.rotary = self.rotary
        residual: torch.Tensor | None = None
        for i in range(self.start, self.end):
            x, residual = self.layers[i](x, residual, batch)
        return x if residual is None else x + residual


class LlamaForCausalLM(CausalLM):
    """HF ``LlamaForCausalLM`` / ``MistralForCausalLM`` / ``Qwen2ForCausalLM``."""

    decoder_layer: ClassVar[LayerFactory] = LlamaDecoderLayer
    packed_modules_mapping: ClassVar[dict[str, tuple[str, str | int]]] = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    # checkpoint tensors that carry no weights (older HF exports)
    ignored_suffixes: ClassVar[tuple[str, ...]] = ("rotary_emb.inv_freq",)

    def __init__(
        self, cfg: ModelConfig, ctx: ShardContext, max_positions: int, partition: str = "even"
    ) -> None:
        """``partition``: layers per pipeline stage, see ``ModelConfig.layer_partition``.
        ``ValueError`` naming the ``config.json`` field this model cannot serve."""
        self.check_config(cfg, max_positions)
        super().__init__(cfg, ctx)
        rotary = self.rotary_tables(cfg, max_positions)
        self.model = LlamaModel(cfg, ctx, self.decoder_layer, rotary, partition)
        self.lm_head = self.build_lm_head(ctx, self.model.embed_tokens)

    @classmethod
    def check_config(cls, cfg: ModelConfig, max_model_len: int) -> None:
        """``ValueError`` naming the ``config.json`` field this model cannot serve at
        ``max_model_len`` tokens. The parent calls it before spawning any rank
        (``launch.validate_replica``); the constructor again."""
        act = str(cfg.extra.get("hidden_act", "silu"))
        if act != "silu":
            raise ValueError(
                f"config.json: hidden_act {act!r} not supported for {cfg.architecture} (silu)"
            )
        check_no_window(cfg, max_model_len)

    @staticmethod
    def rotary_tables(cfg: ModelConfig, max_positions: int) -> RotaryEmbedding:
        """The RoPE tables of every layer, positions ``0 .. max_positions - 1``."""
        return RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope)

    def stage_layers(self) -> range:
        return range(self.model.start, self.model.end)

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        return self.model(x, batch)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Last stage only: ``hidden [N, H]`` (pre-norm) → ``logits [N, vocab]`` in the model's
        dtype (the sampler widens them to float32 only where a row needs more than argmax)."""
        assert self.model.norm is not None and self.lm_head is not None
        return self.lm_head(self.model.norm(hidden)[0])


def check_no_window(cfg: ModelConfig, max_model_len: int) -> None:
    """For a family whose windows are not served (``kv_groups.WINDOWED_ARCHITECTURES``
    are): ``ValueError`` unless sliding-window attention would change nothing: Qwen's
    ``use_sliding_window`` off (then its ``sliding_window`` is unused), else any
    ``sliding_window`` at least ``max_model_len`` (a sequence no longer than the window
    attends to all of it)."""
    if cfg.architecture in WINDOWED_ARCHITECTURES:
        return
    if "use_sliding_window" in cfg.extra:  # Qwen2 / Qwen3: the window applies only when on
        if cfg.extra["use_sliding_window"]:
            raise ValueError(
                "config.json: use_sliding_window is true; sliding-window attention is not "
                "supported yet"
            )
        return
    window = cfg.extra.get("sliding_window")
    if window is not None and window < max_model_len:
        raise ValueError(
            f"config.json: sliding_window {window} is shorter than the {max_model_len}-token "
            f"context; sliding-window attention is not supported yet: serve with "
            f"--max-model-len {window}"
        )
