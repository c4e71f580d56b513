"""What the mixture-of-experts families (Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V2) share:
pre-norm layers whose feed-forward is a :class:`~model_shards.layers.moe.SparseMoeBlock` on
the config's sparse layers and a dense SiLU MLP on the others, and the loader's view of
their experts (:class:`ExpertLayout`).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from model_shards.config.model import ModelConfig
from model_shards.config.moe import MoEConfig, moe_config
from model_shards.layers.context import ShardContext
from model_shards.layers.mlp import GatedMLP
from model_shards.layers.moe import SparseMoeBlock, expert_param_of
from model_shards.models.stack import DecoderLayer
from model_shards.models.stages import LayerFactory

_DENSE_MLP = ("gate_proj.weight", "up_proj.weight", "down_proj.weight")


def experts_of(cfg: ModelConfig) -> MoEConfig:
    """The experts of an MoE family's config (``ValueError`` naming the field if malformed)."""
    moe = moe_config(cfg)
    if moe is None:
        raise ValueError(f"config.json: {cfg.architecture} has no experts")
    moe.check()
    return moe


@dataclass(frozen=True)
class ExpertLayout:
    """A MoE family's layers: pre-norm layers of ``attention`` whose feed-forward, under
    ``ffn_name`` (``mlp``; Mixtral's ``block_sparse_moe``), is a sparse MoE block or a dense
    SiLU MLP (``intermediate_size``); an expert's gate, up and down are the checkpoint's
    ``part_names`` (Mixtral's ``w1``, ``w3``, ``w2``). The per-expert tensors fill the
    stacked expert parameters (:meth:`stacked_param_of`); with expert parallelism each rank
    reads only its own experts."""

    moe: MoEConfig
    attention: LayerFactory
    ffn_name: str = "mlp"
    part_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")

    def layer(self, cfg: ModelConfig, layer_idx: int, ctx: ShardContext) -> DecoderLayer:
        """Decoder layer ``layer_idx`` (a :class:`~model_shards.models.stages.LayerFactory`)."""
        ffn: nn.Module
        if self.moe.is_sparse(layer_idx):
            ffn = SparseMoeBlock(cfg.hidden_size, self.moe, layer_idx, ctx, self.part_names)
        else:
            ffn = GatedMLP(cfg.hidden_size, cfg.intermediate_size, ctx)
        return DecoderLayer(cfg, ctx, self.attention(cfg, layer_idx, ctx), ffn, self.ffn_name)

    def stacked_param_of(self, name: str) -> tuple[str, tuple[int, str]] | None:
        """The loader's hook: a checkpoint expert tensor → the stacked parameter and shard id
        it fills; ``None`` for any other tensor."""
        return expert_param_of(name, self.part_names)

    def checkpoint_names(self, names: set[str], layers_prefix: str, num_layers: int) -> set[str]:
        """``names`` (a dense model's) with each layer's feed-forward tensors those of its own
        kind: the experts' (per expert) or a dense MLP's."""
        ffn = self.ffn_name
        out = {n for n in names if f".{ffn}." not in n}
        sparse = SparseMoeBlock.checkpoint_suffixes(self.moe, self.part_names)
        for i in range(num_layers):
            suffixes = sparse if self.moe.is_sparse(i) else _DENSE_MLP
            out |= {f"{layers_prefix}.{i}.{ffn}.{s}" for s in suffixes}
        return out
