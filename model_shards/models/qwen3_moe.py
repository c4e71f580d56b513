"""Qwen3-MoE (``Qwen3MoeForCausalLM``), tensor-, pipeline- and expert-parallel.

Qwen3's attention (per-head RMSNorm of q and k before RoPE, ``head_dim`` from the config:
:func:`~model_shards.models.qwen3.qwen3_attention`) and, in each sparse layer, a MoE
``mlp``: ``num_experts`` experts of ``moe_intermediate_size``, the top
``num_experts_per_tok`` of a softmax, renormalised when ``norm_topk_prob``; no shared
expert. Layers in ``mlp_only_layers`` or off the ``decoder_sparse_step`` grid keep a dense
MLP. Sliding windows are refused as for Qwen3.
"""

from __future__ import annotations

from model_shards.config.model import ModelConfig
from model_shards.layers.context import ShardContext
from model_shards.models.causal_lm import DecoderLM
from model_shards.models.qwen3 import Qwen3Options, qwen3_attention
from model_shards.models.sparse_moe import ExpertLayout, experts_of


class Qwen3MoeForCausalLM(DecoderLM):
    """HF ``Qwen3MoeForCausalLM``: one pipeline stage on one TP rank."""

    @classmethod
    def check_config(cls, cfg: ModelConfig, max_model_len: int) -> None:
        """The MoE checks, then Qwen3's (sliding windows refused)."""
        super().check_config(cfg, max_model_len)
        Qwen3Options.parse(cfg)

    def __init__(
        self, cfg: ModelConfig, ctx: ShardContext, max_positions: int, partition: str = "even"
    ) -> None:
        self.check_config(cfg, max_positions)
        experts = ExpertLayout(experts_of(cfg), qwen3_attention)
        super().__init__(cfg, ctx, max_positions, partition, experts.layer, experts=experts)
