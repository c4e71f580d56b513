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

from dataclasses import replace

from model_shards.config.model import ModelConfig
from model_shards.layers.context import ShardContext
from model_shards.layers.linear import RowParallelLinear
from model_shards.models.llama import LlamaAttention
from model_shards.models.sparse_moe import MoEDecoderLayer, MoEForCausalLM


class Qwen2MoeAttention(LlamaAttention):
    """Llama's attention with q/k/v biased as ``qkv_bias`` says and o never biased."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, ctx: ShardContext) -> None:
        qkv_bias = bool(cfg.extra.get("qkv_bias", True))
        super().__init__(replace(cfg, attention_bias=qkv_bias), layer_idx, ctx)
        if qkv_bias:  # Llama's attention biases o too whenever q/k/v are
            self.o_proj = RowParallelLinear(
                cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False, ctx=ctx
            )


class Qwen2MoeDecoderLayer(MoEDecoderLayer):
    """Llama's block around :class:`Qwen2MoeAttention`, a MoE ``mlp`` with a shared expert."""

    attention_class = Qwen2MoeAttention


class Qwen2MoeForCausalLM(MoEForCausalLM):
    """HF ``Qwen2MoeForCausalLM``: one pipeline stage on one TP rank."""

    decoder_layer = Qwen2MoeDecoderLayer
