"""Qwen3-MoE (``Qwen3MoeForCausalLM``), tensor-, pipeline- and expert-parallel.

Qwen3's attention (per-head RMSNorm of q and k before RoPE, ``head_dim`` from the config:
:class:`~model_shards.models.qwen3.Qwen3Attention`) and, in each sparse layer, a MoE
``mlp``: ``num_experts`` experts of ``moe_intermediate_size``, the top
``num_experts_per_tok`` of a softmax, renormalised when ``norm_topk_prob``; no shared
expert. Layers in ``mlp_only_layers`` or off the ``decoder_sparse_step`` grid keep a dense
MLP. Sliding windows are refused as for Qwen3.
"""

from __future__ import annotations

from model_shards.config.model import ModelConfig
from model_shards.models.qwen3 import Qwen3Attention, Qwen3Options
from model_shards.models.sparse_moe import MoEDecoderLayer, MoEForCausalLM


class Qwen3MoeDecoderLayer(MoEDecoderLayer):
    """Llama's block around Qwen3's QK-normed attention, a MoE ``mlp``."""

    attention_class = Qwen3Attention


class Qwen3MoeForCausalLM(MoEForCausalLM):
    """HF ``Qwen3MoeForCausalLM``: one pipeline stage on one TP rank."""

    decoder_layer = Qwen3MoeDecoderLayer

    @classmethod
    def check_config(cls, cfg: ModelConfig, max_model_len: int) -> None:
        """The MoE checks, then Qwen3's (sliding windows refused)."""
        super().check_config(cfg, max_model_len)
        Qwen3Options.parse(cfg)
