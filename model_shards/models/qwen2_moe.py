"""Qwen2-MoE / Qwen1.5-MoE (``Qwen2MoeForCausalLM``), tensor-, pipeline- and expert-parallel.

Qwen2's attention: q/k/v with a bias (``qkv_bias``, default true), o without. Each sparse
layer's ``mlp`` is a MoE block: ``num_experts`` experts of ``moe_intermediate_size``,
the top ``num_experts_per_tok`` of a softmax (renormalised only when ``norm_topk_prob``),
plus a shared expert of ``shared_expert_intermediate_size`` that every token goes
through, scaled by ``sigmoid(shared_expert_gate(x))`` (:mod:`model_shards.layers.moe`).
Layers in ``mlp_only_layers`` or off the ``decoder_sparse_step`` grid keep a dense MLP
of ``intermediate_size``. Sliding windows are refused (``use_sliding_window``).
"""

from __future__ import annotations

from model_shards.config.model import ModelConfig
from model_shards.layers.context import ShardContext
from model_shards.layers.rotary_attention import AttentionOptions, RotaryAttention
from model_shards.models.causal_lm import DecoderLM
from model_shards.models.sparse_moe import ExpertLayout, experts_of


def qwen2_moe_attention(cfg: ModelConfig, layer_idx: int, ctx: ShardContext) -> RotaryAttention:
    options = AttentionOptions(qkv_bias=bool(cfg.extra.get("qkv_bias", True)))
    return RotaryAttention(cfg, layer_idx, ctx, options)


class Qwen2MoeForCausalLM(DecoderLM):
    """HF ``Qwen2MoeForCausalLM``: one pipeline stage on one TP rank."""

    def __init__(
        self, cfg: ModelConfig, ctx: ShardContext, max_positions: int, partition: str = "even"
    ) -> None:
        self.check_config(cfg, max_positions)
        experts = ExpertLayout(experts_of(cfg), qwen2_moe_attention)
        super().__init__(cfg, ctx, max_positions, partition, experts.layer, experts=experts)
