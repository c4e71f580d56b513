"""Qwen3 decoder (``Qwen3ForCausalLM``), tensor- and pipeline-parallel.

Llama's layer with one change in attention: before RoPE, every query and key head is
RMS-normalised on its own, ``q_h = w_q * q_h / rms(q_h)`` (``q_norm``/``k_norm``, weights
``[head_dim]`` shared by all heads, so replicated on every TP rank). ``head_dim`` is the
config's, independent of ``hidden_size / num_attention_heads``. Sliding windows
(``use_sliding_window``) are served through the KV groups of
:mod:`model_shards.config.kv_layout`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from model_shards.config.kv_layout import WINDOWED_ARCHITECTURES
from model_shards.config.model import ModelConfig
from model_shards.layers.context import ShardContext
from model_shards.layers.rotary_attention import QKNorm, RotaryAttention
from model_shards.models.causal_lm import DecoderLM
from model_shards.models.llama import llama_attention_options
from model_shards.models.stack import dense_layers


@dataclass(frozen=True)
class Qwen3Options:
    """Qwen3's own ``config.json`` fields (beyond :class:`ModelConfig`) that decide whether
    we can serve the checkpoint; :meth:`parse` refuses the ones we cannot."""

    use_sliding_window: bool
    layer_types: tuple[str, ...]  # empty when the config does not list them

    @staticmethod
    def parse(cfg: ModelConfig) -> Qwen3Options:
        """Read ``cfg.extra``; ``ValueError`` naming the field when it asks for sliding
        windows (not supported)."""
        raw = cfg.extra
        options = Qwen3Options(
            use_sliding_window=bool(raw.get("use_sliding_window", False)),
            layer_types=tuple(str(t) for t in raw.get("layer_types") or ()),
        )
        if cfg.architecture in WINDOWED_ARCHITECTURES:
            return options  # windows served (model_shards.config.kv_layout)
        if options.use_sliding_window:
            raise ValueError(
                "config.json: use_sliding_window is true, but sliding-window attention is not "
                "supported yet; shardserve serves Qwen3 with full attention "
                "(use_sliding_window: false)"
            )
        windowed = sorted({t for t in options.layer_types if t != "full_attention"})
        if windowed:
            raise ValueError(
                f"config.json: layer_types lists {windowed}; only 'full_attention' layers are "
                f"supported (sliding-window attention is not supported yet)"
            )
        return options


def qwen3_attention(cfg: ModelConfig, layer_idx: int, ctx: ShardContext) -> RotaryAttention:
    """Llama's attention with every q and k head RMS-normalised before RoPE."""
    options = replace(llama_attention_options(cfg), qk_norm=QKNorm("head"))
    return RotaryAttention(cfg, layer_idx, ctx, options)


class Qwen3ForCausalLM(DecoderLM):
    """HF ``Qwen3ForCausalLM``: one pipeline stage on one TP rank."""

    @classmethod
    def check_config(cls, cfg: ModelConfig, max_model_len: int) -> None:
        """Llama's checks, then :meth:`Qwen3Options.parse`'s (sliding windows refused)."""
        super().check_config(cfg, max_model_len)
        Qwen3Options.parse(cfg)

    def __init__(
        self, cfg: ModelConfig, ctx: ShardContext, max_positions: int, partition: str = "even"
    ) -> None:
        self.check_config(cfg, max_positions)
        super().__init__(cfg, ctx, max_positions, partition, dense_layers(qwen3_attention))
