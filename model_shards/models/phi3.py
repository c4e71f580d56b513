"""Phi-3 decoder (``Phi3ForCausalLM``: Phi-3, Phi-3.5 mini, Phi-4 mini), tensor- and
pipeline-parallel.

Llama's layer (pre-norm RMSNorm, grouped-query attention, SwiGLU MLP, no biases,
``head_dim = hidden_size / num_attention_heads``) with three differences:

* the checkpoint's projections are fused: ``self_attn.qkv_proj.weight`` (rows
  ``[q; k; v]``) and ``mlp.gate_up_proj.weight`` (rows ``[gate; up]``); each rank reads
  only its rows of each part (:mod:`~model_shards.layers.fused_sources`), so
  ``packed_modules_mapping`` maps nothing;
* RoPE may be ``longrope`` (short/long factors and an attention factor on cos and sin,
  the short set below ``original_max_position_embeddings``, see
  :mod:`~model_shards.layers.rotary` for where that differs from transformers: only at
  the positions below it of sequences longer than it);
* ``partial_rotary_factor`` (Phi-4 mini: 0.75) turns only the first
  ``R = int(head_dim * factor)`` dims of each head: q and k heads are stored in
  :func:`~model_shards.layers.rotary.rotary_head_order`'s order, so the backend's
  whole-head rotation is that partial one.

``sliding_window`` applies to every layer (a token attends to the ``sliding_window``
latest positions, itself included), served through :mod:`model_shards.config.kv_layout`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from model_shards.config.model import ModelConfig
from model_shards.layers.context import ShardContext
from model_shards.layers.mlp import GatedMLP
from model_shards.layers.rotary import RotaryEmbedding, rotary_head_order
from model_shards.layers.rotary_attention import AttentionOptions, RotaryAttention
from model_shards.models.causal_lm import DecoderLM
from model_shards.models.stack import DecoderLayer


def _partial_rotary_factor(cfg: ModelConfig) -> float:
    raw = cfg.extra
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    return float(params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)))


def rotary_dim(cfg: ModelConfig) -> int:
    """``R``: the rotated dims of each head, ``int(head_dim * partial_rotary_factor)``."""
    return int(cfg.head_dim * _partial_rotary_factor(cfg))


@dataclass(frozen=True)
class Phi3Options:
    """Phi-3's own ``config.json`` fields (beyond :class:`ModelConfig`)."""

    rotary_dim: int  # R: the rotated dims of each head (head_dim * partial_rotary_factor)
    sliding_window: int | None

    @staticmethod
    def parse(cfg: ModelConfig, max_positions: int) -> Phi3Options:
        """Read ``cfg.extra``; ``ValueError`` naming the field when it asks for something not
        supported (a partial rotary split with an odd part, longrope factors not one per
        rotated frequency)."""
        window = cfg.extra.get("sliding_window")  # served (model_shards.config.kv_layout)
        r = rotary_dim(cfg)
        try:
            rotary_head_order(cfg.head_dim, r)
        except ValueError as exc:
            factor = _partial_rotary_factor(cfg)
            raise ValueError(f"config.json: partial_rotary_factor {factor}: {exc}") from exc
        rope = cfg.rope
        factor_sets = {"short_factor": rope.short_factor, "long_factor": rope.long_factor}
        for which, factors in factor_sets.items():
            if rope.rope_type == "longrope" and len(factors) != r // 2:
                raise ValueError(
                    f"config.json: rope {which} has {len(factors)} entries, expected {r // 2} "
                    f"(half the rotary dim {r})"
                )
        return Phi3Options(r, None if window is None else int(window))


def phi3_layer(cfg: ModelConfig, layer_idx: int, ctx: ShardContext) -> DecoderLayer:
    """Llama's pre-norm layer, q/k/v and gate/up each read from one fused tensor."""
    options = AttentionOptions(fused_checkpoint=True, rotary_dim=rotary_dim(cfg))
    attn = RotaryAttention(cfg, layer_idx, ctx, options)
    mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, ctx, fused_checkpoint=True)
    return DecoderLayer(cfg, ctx, attn, mlp)


class Phi3ForCausalLM(DecoderLM):
    """HF ``Phi3ForCausalLM``: one pipeline stage on one TP rank."""

    # the checkpoint's projections are already fused: names match the parameters'
    packed_modules_mapping: ClassVar[dict[str, tuple[str, str | int]]] = {}

    @classmethod
    def check_config(cls, cfg: ModelConfig, max_model_len: int) -> None:
        """Llama's checks, then :meth:`Phi3Options.parse`'s at ``max_model_len``."""
        super().check_config(cfg, max_model_len)
        Phi3Options.parse(cfg, max_model_len)

    def __init__(
        self, cfg: ModelConfig, ctx: ShardContext, max_positions: int, partition: str = "even"
    ) -> None:
        self.check_config(cfg, max_positions)
        # longrope or default tables turning the first R dims of each head
        rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope, rotary_dim(cfg))
        super().__init__(cfg, ctx, max_positions, partition, phi3_layer, rotary=rotary)
