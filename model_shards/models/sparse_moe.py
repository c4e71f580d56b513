"""What the mixture-of-experts families (Mixtral, Qwen2-MoE, Qwen3-MoE) share: Llama's stack
with the feed-forward of each sparse layer a :class:`~model_shards.layers.moe.SparseMoeBlock`.

A family subclasses :class:`MoEForCausalLM` and sets its layer class, a subclass of
:class:`MoEDecoderLayer` naming the attention class, the attribute the feed-forward lives
under in the checkpoint (``mlp``, Mixtral's ``block_sparse_moe``) and an expert's tensor
names. Layers the config marks dense keep Llama's MLP. The checkpoint's per-expert tensors
fill the stacked expert parameters (:meth:`MoEForCausalLM.stacked_param_of`, the loader's
hook); with expert parallelism each rank reads only its own experts.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from model_shards.config.model import ModelConfig
from model_shards.config.moe import MoEConfig, moe_config
from model_shards.layers.attention import ForwardBatch
from model_shards.layers.context import ShardContext
from model_shards.layers.moe import SparseMoeBlock, expert_param_of
from model_shards.layers.norm import RMSNorm
from model_shards.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP
from model_shards.models.stages import LayerFactory


def experts_of(cfg: ModelConfig) -> MoEConfig:
    """The experts of an MoE family's config (``ValueError`` naming the field if malformed)."""
    moe = moe_config(cfg)
    if moe is None:
        raise ValueError(f"config.json: {cfg.architecture} has no experts")
    moe.check()
    return moe


class MoEDecoderLayer(nn.Module):
    """Llama's pre-norm block, ``h = x + attn(norm(x))``, ``out = h + ffn(norm(h))``, where
    ``ffn`` (attribute :attr:`ffn_name`) is a sparse MoE block on sparse layers and
    Llama's dense MLP (``intermediate_size``) on the others."""

    attention_class: ClassVar[LayerFactory] = LlamaAttention
    ffn_name: ClassVar[str] = "mlp"
    expert_part_names: ClassVar[tuple[str, str, str]] = ("gate_proj", "up_proj", "down_proj")

    def __init__(self, cfg: ModelConfig, layer_idx: int, ctx: ShardContext) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ctx)
        self.self_attn = self.attention_class(cfg, layer_idx, ctx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ctx)
        moe = experts_of(cfg)
        ffn: nn.Module = LlamaMLP(cfg, ctx)
        if moe.is_sparse(layer_idx):
            ffn = SparseMoeBlock(cfg.hidden_size, moe, layer_idx, ctx, self.expert_part_names)
        self.add_module(self.ffn_name, ffn)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, batch: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x, residual)`` → ``(ffn_out, residual)``, as Llama's layer."""
        h, residual = self.input_layernorm(x, residual)
        h, residual = self.post_attention_layernorm(self.self_attn(h, batch), residual)
        ffn: nn.Module = getattr(self, self.ffn_name)
        return ffn(h), residual


class MoEForCausalLM(LlamaForCausalLM):
    """Llama's causal LM over :class:`MoEDecoderLayer` layers (a family sets the subclass)."""

    decoder_layer: ClassVar[type[MoEDecoderLayer]] = MoEDecoderLayer

    @classmethod
    def check_config(cls, cfg: ModelConfig, max_model_len: int) -> None:
        """Llama's checks, then the experts' fields (:meth:`MoEConfig.check`)."""
        super().check_config(cfg, max_model_len)
        experts_of(cfg)

    def stacked_param_of(self, name: str) -> tuple[str, tuple[int, str]] | None:
        """The loader's hook: a checkpoint expert tensor → the stacked parameter and shard id
        it fills (:func:`~model_shards.layers.moe.expert_param_of`); ``None`` otherwise."""
        return expert_param_of(name, self.decoder_layer.expert_part_names)

    def expected_checkpoint_names(self) -> set[str]:
        """Llama's names, with each layer's feed-forward tensors those of its own kind
        (the experts' per expert, or a dense MLP's)."""
        layer_cls, prefix = self.decoder_layer, self.layers_prefix
        ffn = layer_cls.ffn_name
        names = {n for n in super().expected_checkpoint_names() if f".{ffn}." not in n}
        moe = experts_of(self.config)
        dense = ["gate_proj.weight", "up_proj.weight", "down_proj.weight"]
        sparse = SparseMoeBlock.checkpoint_suffixes(moe, layer_cls.expert_part_names)
        for i in range(self.config.num_layers):
            suffixes = sparse if moe.is_sparse(i) else dense
            names |= {f"{prefix}.{i}.{ffn}.{s}" for s in suffixes}
        return names
