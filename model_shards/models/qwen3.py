"""Qwen3 decoder (``Qwen3ForCausalLM``), tensor- and pipeline-parallel.

Llama's layer with one change in attention: before RoPE, every query and key head is
RMS-normalised on its own, ``q_h = w_q * q_h / rms(q_h)`` and ``k_h = w_k * k_h / rms(k_h)``
(``q_norm``/``k_norm``, weights ``[head_dim]`` shared by all heads, so replicated on every
TP rank; the statistics in float32, eps ``rms_norm_eps``). ``head_dim`` is the config's,
independent of ``hidden_size / num_attention_heads``; q/k/v and o carry a bias only when
``attention_bias`` says so. Sliding windows (``use_sliding_window``) are served through the
KV groups of :mod:`model_shards.config.kv_layout`.

The stack, the checkpoint names and the (possibly tied) LM head are Llama's
(:class:`~model_shards.models.llama.LlamaForCausalLM`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from model_shards.config.kv_layout import WINDOWED_ARCHITECTURES
from model_shards.config.model import ModelConfig
from model_shards.layers.attention import ForwardBatch
from model_shards.layers.context import ShardContext
from model_shards.layers.norm import RMSNorm
from model_shards.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM


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


class Qwen3Attention(LlamaAttention):
    """QKV column-parallel → per-head RMSNorm of q and k → RoPE + K/V write → attention →
    o row-parallel. Each rank normalises its own heads (the norm never crosses heads)."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, ctx: ShardContext) -> None:
        super().__init__(cfg, layer_idx, ctx)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, ctx)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, ctx)

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        qkv = self.qkv_proj(x)  # [T, (nh + 2 nkv) * D]
        heads = (self.num_heads, self.num_kv_heads)
        normalize_heads(qkv, heads, self.head_dim, self.q_norm, self.k_norm)
        o = self.attn(qkv, batch)  # [T, nh * D]
        return self.o_proj(o)  # [T, H]


def normalize_heads(
    qkv: torch.Tensor, heads: tuple[int, int], head_dim: int, q_norm: RMSNorm, k_norm: RMSNorm
) -> None:
    """RMSNorm each q and k head of ``qkv [T, (nh + 2 nkv) * D]`` in place (v untouched),
    ``heads = (nh, nkv)``, through the norms' backend ``rms_norm`` on ``[T * heads, D]``
    rows (Qwen3, Gemma 3)."""
    t, d = qkv.shape[0], head_dim
    q_size, kv_size = heads[0] * d, heads[1] * d
    q = qkv[:, :q_size].reshape(t * heads[0], d)  # [T * nh, D] (a copy)
    k = qkv[:, q_size : q_size + kv_size].reshape(t * heads[1], d)  # [T * nkv, D]
    qkv[:, :q_size] = q_norm(q)[0].view(t, q_size)
    qkv[:, q_size : q_size + kv_size] = k_norm(k)[0].view(t, kv_size)


class Qwen3DecoderLayer(LlamaDecoderLayer):
    """Llama's pre-norm block around :class:`Qwen3Attention`."""

    attention_class = Qwen3Attention


class Qwen3ForCausalLM(LlamaForCausalLM):
    """HF ``Qwen3ForCausalLM``: one pipeline stage on one TP rank."""

    decoder_layer = Qwen3DecoderLayer

    @classmethod
    def check_config(cls, cfg: ModelConfig, max_model_len: int) -> None:
        """Llama's checks, then :meth:`Qwen3Options.parse`'s (sliding windows refused)."""
        super().check_config(cfg, max_model_len)
        Qwen3Options.parse(cfg)
