"""Mixtral (``MixtralForCausalLM``), tensor-, pipeline- and expert-parallel.

Llama's attention (GQA, no bias; a ``sliding_window`` shorter than the context refused as
for Mistral) and, in every layer, a sparse MoE block under ``block_sparse_moe``:
``num_local_experts`` experts of ``intermediate_size``, each token routed to the top
``num_experts_per_tok`` of a softmax over the router logits, their weights renormalised
to sum 1 (:mod:`model_shards.layers.moe`). An expert's gate, up and down are the
checkpoint's ``w1``, ``w3`` and ``w2``. No shared expert.
"""

from __future__ import annotations

from model_shards.models.sparse_moe import MoEDecoderLayer, MoEForCausalLM


class MixtralDecoderLayer(MoEDecoderLayer):
    """Llama's block with ``block_sparse_moe`` as its feed-forward."""

    ffn_name = "block_sparse_moe"
    expert_part_names = ("w1", "w3", "w2")


class MixtralForCausalLM(MoEForCausalLM):
    """HF ``MixtralForCausalLM``: one pipeline stage on one TP rank."""

    decoder_layer = MixtralDecoderLayer
