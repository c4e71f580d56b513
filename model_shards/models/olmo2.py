"""OLMo 2 decoder (HF ``Olmo2ForCausalLM``), tensor- and pipeline-parallel.

Differs from Llama in two places, both read from the Hugging Face model:

* post-norms: no input norm; each sub-block's *output* is normalized before it joins the
  residual stream, ``h = x + post_attention_layernorm(attn(x))``,
  ``out = h + post_feedforward_layernorm(mlp(h))``;
* QK-norm over the whole projection: ``q_norm`` is one RMSNorm over all
  ``num_heads * head_dim`` q features (``k_norm`` over ``num_kv_heads * head_dim``),
  applied before RoPE; under TP its statistic spans the TP group
  (:class:`~model_shards.layers.sharded_norm.ShardedRMSNorm`).

RoPE, the SwiGLU MLP, the stack, the untied LM head and the checkpoint names are Llama's.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from model_shards.config.model import ModelConfig
from model_shards.layers.attention import ForwardBatch
from model_shards.layers.context import ShardContext
from model_shards.layers.mlp import GatedMLP
from model_shards.layers.norm import RMSNorm
from model_shards.layers.rotary_attention import QKNorm, RotaryAttention
from model_shards.models.causal_lm import DecoderLM
from model_shards.models.llama import llama_attention_options


class Olmo2DecoderLayer(nn.Module):
    """Post-norm block. The norms are the backend's RMSNorm (fused kernels), which rounds
    the normalized value to the dtype before the weight multiply; HF's ``Olmo2RMSNorm``
    multiplies in float32 and rounds once: the same in float32, one rounding apart in
    bfloat16."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, ctx: ShardContext) -> None:
        super().__init__()
        options = replace(llama_attention_options(cfg), qk_norm=QKNorm("projection"))
        self.self_attn = RotaryAttention(cfg, layer_idx, ctx, options)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ctx)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, ctx)
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ctx)

    def forward(
        self, x: torch.Tensor, residual: None, batch: ForwardBatch
    ) -> tuple[torch.Tensor, None]:
        """``x: [T, H]`` → ``(out [T, H], None)``: the residual stream is explicit (no fused
        add), so nothing is carried to the next layer (``residual`` is always ``None``)."""
        h = x + self.post_attention_layernorm(self.self_attn(x, batch))[0]  # [T, H]
        return h + self.post_feedforward_layernorm(self.mlp(h))[0], None  # [T, H]


class Olmo2ForCausalLM(DecoderLM):
    """HF ``Olmo2ForCausalLM``: a stack of :class:`Olmo2DecoderLayer`."""

    def __init__(
        self, cfg: ModelConfig, ctx: ShardContext, max_positions: int, partition: str = "even"
    ) -> None:
        self.check_config(cfg, max_positions)
        super().__init__(cfg, ctx, max_positions, partition, Olmo2DecoderLayer)
