"""Gemma 2 and Gemma 3 text decoders (HF ``Gemma2ForCausalLM``, ``Gemma3ForCausalLM``).

What differs from Llama, each read from the Hugging Face model:

* sliding-window layers interleaved with global ones (``layer_types``; Gemma 2 alternates,
  Gemma 3 has five sliding to one global): the KV groups of :mod:`model_shards.config.kv_layout`
  give every type its own block table, and a sliding layer's blocks leave the pool as
  they leave its window;
* ``(1 + w)`` RMSNorm (the checkpoint stores ``w``; loaded as ``1 + w`` in float32 and
  rounded once to the dtype: exact in float32), before *and after* each sub-block:
  ``h = x + post_attention_layernorm(attn(input_layernorm(x)))``,
  ``out = h + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(h)))``;
* embeddings times ``sqrt(hidden_size)`` (rounded to the dtype first, as transformers does),
  the LM head tied to the unscaled embedding;
* a GELU-tanh gated MLP, ``down(gelu_tanh(gate(x)) * up(x))``;
* attention scores scaled by ``query_pre_attn_scalar ** -0.5``, Gemma 2's scores and final
  logits soft-capped, ``cap * tanh(s / cap)`` (``attn_logit_softcapping``,
  ``final_logit_softcapping``);
* Gemma 3: per-head QK-norm before RoPE (Qwen3's, with Gemma's norm) and one rope theta per
  layer type (``rope_parameters.{full,sliding}_attention``; older configs:
  ``rope_theta`` and ``rope_local_base_freq``).

Every backend's attention takes the window and the soft-cap (the C++ decode kernels, the
Triton decode and prefill kernels, the reference); the GELU is PyTorch's ``F.gelu``.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from model_shards.config.kv_layout import layer_windows
from model_shards.config.model import ModelConfig
from model_shards.config.rope import RopeConfig, parse_rope
from model_shards.layers.attention import ForwardBatch
from model_shards.layers.context import ShardContext
from model_shards.layers.linear import copy_checked
from model_shards.layers.mlp import GatedMLP
from model_shards.layers.norm import RMSNorm
from model_shards.layers.rotary import RotaryEmbedding
from model_shards.layers.rotary_attention import AttentionOptions, QKNorm, RotaryAttention
from model_shards.models.causal_lm import DecoderLM
from model_shards.worker.checkpoint import TensorSource

_GELU_TANH = ("gelu_pytorch_tanh", "gelu_tanh", "gelu_new")
_LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclass(frozen=True)
class GemmaOptions:
    """Gemma's own ``config.json`` fields; :meth:`parse` refuses what we cannot serve."""

    final_softcap: float | None
    attention: AttentionOptions  # score scale, soft-cap, Gemma 3's per-head QK-norm
    ropes: Mapping[str, RopeConfig]  # per layer type

    @staticmethod
    def parse(cfg: ModelConfig) -> GemmaOptions:
        raw = cfg.extra
        act = str(raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh")
        if act not in _GELU_TANH:
            raise ValueError(
                f"config.json: hidden_activation {act!r} not supported for "
                f"{cfg.architecture} ({', '.join(_GELU_TANH)})"
            )
        if raw.get("use_bidirectional_attention"):
            raise ValueError("config.json: use_bidirectional_attention is not supported")
        gemma3 = cfg.architecture == "Gemma3ForCausalLM"
        attention = AttentionOptions(
            qkv_bias=cfg.attention_bias,
            o_bias=cfg.attention_bias,
            qk_norm=QKNorm("head", GemmaRMSNorm) if gemma3 else None,
            scale=float(raw.get("query_pre_attn_scalar", cfg.head_dim)) ** -0.5,
            softcap=_optional_float(raw.get("attn_logit_softcapping")),
        )
        return GemmaOptions(
            final_softcap=_optional_float(raw.get("final_logit_softcapping")),
            attention=attention,
            ropes=_gemma3_ropes(raw) if gemma3 else dict.fromkeys(_LAYER_TYPES, cfg.rope),
        )


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)


def _gemma3_ropes(raw: Mapping[str, Any]) -> dict[str, RopeConfig]:
    """Gemma 3's rope per layer type, from either spelling of its config."""
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:
        per_type = {t: dict(params.get(t) or {}) for t in _LAYER_TYPES}
    else:  # transformers < 5: rope_theta (+ rope_scaling) global, rope_local_base_freq local
        per_type = {
            "full_attention": {
                **(raw.get("rope_scaling") or {}),
                "rope_theta": raw.get("rope_theta", 1_000_000.0),
            },
            "sliding_attention": {"rope_theta": raw.get("rope_local_base_freq", 10_000.0)},
        }
    positions = raw.get("max_position_embeddings", 8192)
    return {
        t: parse_rope({"rope_parameters": p, "max_position_embeddings": positions})
        for t, p in per_type.items()
    }


class GemmaRMSNorm(RMSNorm):
    """``y = (1 + w) * x / rms(x)``: the checkpoint's ``w`` is loaded as ``1 + w``."""

    def weight_loader(self, param: nn.Parameter, source: TensorSource) -> None:
        copy_checked(param.data, source.read().float() + 1.0, source.name)


class GemmaDecoderLayer(nn.Module):
    """Pre- and post-norm block (see the module docstring); the residual adds are fused
    into the following norms, ``(x, residual) -> (x, residual)`` like Llama's layer."""

    def __init__(
        self,
        cfg: ModelConfig,
        layer_idx: int,
        ctx: ShardContext,
        *,
        options: GemmaOptions,
        rotary: Mapping[str, RotaryEmbedding],
    ) -> None:
        super().__init__()
        eps, h = cfg.rms_norm_eps, cfg.hidden_size
        sliding = layer_windows(cfg)[layer_idx] is not None
        tables = rotary["sliding_attention" if sliding else "full_attention"]
        self.input_layernorm = GemmaRMSNorm(h, eps, ctx)
        self.self_attn = RotaryAttention(cfg, layer_idx, ctx, options.attention, tables)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps, ctx)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps, ctx)
        self.mlp = GatedMLP(h, cfg.intermediate_size, ctx, act="gelu_tanh")
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps, ctx)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, batch: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's output is the sum of the returned pair (as in Llama's layer)."""
        h, residual = self.input_layernorm(x, residual)  # residual: the block's input
        a = self.post_attention_layernorm(self.self_attn(h, batch))[0]  # [T, H]
        h, residual = self.pre_feedforward_layernorm(a, residual)  # residual: x + a
        return self.post_feedforward_layernorm(self.mlp(h))[0], residual


class GemmaForCausalLM(DecoderLM):
    """HF ``Gemma2ForCausalLM`` / ``Gemma3ForCausalLM``: a stack of
    :class:`GemmaDecoderLayer` with the embedding scale and the final soft-cap."""

    @classmethod
    def check_config(cls, cfg: ModelConfig, max_model_len: int) -> None:
        """:meth:`GemmaOptions.parse`'s refusals (windows are served), not Llama's."""
        GemmaOptions.parse(cfg)

    def __init__(
        self, cfg: ModelConfig, ctx: ShardContext, max_positions: int, partition: str = "even"
    ) -> None:
        self.check_config(cfg, max_positions)
        options = GemmaOptions.parse(cfg)
        tables = {
            t: RotaryEmbedding(cfg.head_dim, max_positions, r) for t, r in options.ropes.items()
        }
        super().__init__(
            cfg,
            ctx,
            max_positions,
            partition,
            functools.partial(GemmaDecoderLayer, options=options, rotary=tables),
            rotary=tables["full_attention"],
            norm_class=GemmaRMSNorm,
            embed_scale=torch.tensor(cfg.hidden_size**0.5).to(ctx.dtype),
        )
        self.final_softcap = options.final_softcap

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)  # [N, V]
        if self.final_softcap is None:
            return logits
        return torch.tanh(logits / self.final_softcap) * self.final_softcap
