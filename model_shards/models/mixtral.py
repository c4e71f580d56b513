"""Mixtral (``MixtralForCausalLM``), tensor-, pipeline- and expert-parallel.

Llama's attention (GQA, no bias; a ``sliding_window`` shorter than the context refused as
for Mistral) and, in every layer, a sparse MoE block under ``block_sparse_moe``:
``num_local_experts`` experts of ``intermediate_size``, each token routed to the top
``num_experts_per_tok`` of a softmax over the router logits, their weights renormalised
to sum 1 (:mod:`model_shards.layers.moe`). An expert's gate, up and down are the
checkpoint's ``w1``, ``w3`` and ``w2``. No shared expert.
"""

from __future__ import annotations

from model_shards.config.model import ModelConfig
from model_shards.layers.context import ShardContext
from model_shards.models.causal_lm import DecoderLM
from model_shards.models.llama import llama_attention
from model_shards.models.sparse_moe import ExpertLayout, experts_of


class MixtralForCausalLM(DecoderLM):
    """HF ``MixtralForCausalLM``: one pipeline stage on one TP rank."""

    def __init__(
        self, cfg: ModelConfig, ctx: ShardContext, max_positions: int, partition: str = "even"
    ) -> None:
        self.check_config(cfg, max_positions)
        experts = ExpertLayout(
            experts_of(cfg), llama_attention, "block_sparse_moe", ("w1", "w3", "w2")
        )
        super().__init__(cfg, ctx, max_positions, partition, experts.layer, experts=experts)
