"""Llama-family decoder (Llama, Mistral, Qwen2), tensor- and pipeline-parallel.

Reads like the Hugging Face model; sharding lives in the layers. Pre-norm layers of
:class:`~model_shards.layers.rotary_attention.RotaryAttention` and a SiLU
:class:`~model_shards.layers.mlp.GatedMLP`, stacked by
:class:`~model_shards.models.causal_lm.DecoderLM`.
"""

from __future__ import annotations

from model_shards.config.model import ModelConfig
from model_shards.layers.context import ShardContext
from model_shards.layers.rotary_attention import AttentionOptions, RotaryAttention
from model_shards.models.causal_lm import DecoderLM
from model_shards.models.stack import dense_layers

# Qwen2's language models: q/k/v biased, o not
_NO_O_BIAS = ("Qwen2ForCausalLM", "Qwen2_5_VLForConditionalGeneration")


def llama_attention_options(cfg: ModelConfig) -> AttentionOptions:
    """q/k/v biased when ``attention_bias`` says so, and o too, except in Qwen2 and
    Qwen2.5-VL (whose configs force the q/k/v bias; their o has none)."""
    o_bias = cfg.attention_bias and cfg.architecture not in _NO_O_BIAS
    return AttentionOptions(qkv_bias=cfg.attention_bias, o_bias=o_bias)


def llama_attention(cfg: ModelConfig, layer_idx: int, ctx: ShardContext) -> RotaryAttention:
    return RotaryAttention(cfg, layer_idx, ctx, llama_attention_options(cfg))


class LlamaForCausalLM(DecoderLM):
    """HF ``LlamaForCausalLM`` / ``MistralForCausalLM`` / ``Qwen2ForCausalLM``."""

    def __init__(
        self, cfg: ModelConfig, ctx: ShardContext, max_positions: int, partition: str = "even"
    ) -> None:
        self.check_config(cfg, max_positions)
        super().__init__(cfg, ctx, max_positions, partition, dense_layers(llama_attention))
