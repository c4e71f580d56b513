"""Qwen3 decoder (``Qwen3ForCausalLM``), tensor- and pipeline-parallel.

Llama's layer with one change in attention: before RoPE, every query and key head is
RMS-normalised on its own, ``q_h = w_q * q_h / rms(q_h)`` and ``k_h = w_k * k_h / rms(k_h)``
(``q_norm``/``k_norm``, weights ``[head_dim]`` shared by all heads, so replicated on every
TP rank; the statistics in float32, eps ``rms_norm_eps``). ``head_dim`` is the config's,
independent of ``hidden_size / num_attention_heads``; q/k/v and o carry a bias only when
``attention_bias`` says so. Sliding-window attention is refused (not supported yet).

As in :mod:`~model_shards.models.llama`, a stage builds only its layers ``[start, end)``
(others are :class:`MissingLayer` placeholders so names match the checkpoint's); the first
stage owns the embedding, the last the final norm and the (possibly tied) LM head.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from model_shards.config import ModelConfig
from model_shards.layers.attention import Attention, ForwardBatch
from model_shards.layers.context import ShardContext
from model_shards.layers.linear import QKVParallelLinear, RowParallelLinear
from model_shards.layers.norm import RMSNorm
from model_shards.layers.rotary import RotaryEmbedding
from model_shards.layers.vocab import ParallelLMHead, VocabParallelEmbedding
from model_shards.models.llama import LlamaMLP
from model_shards.models.naming import checkpoint_names_of
from model_shards.models.stages import MissingLayer, stage_layer_range


@dataclass(frozen=True)
class Qwen3Options:
    """Qwen3's own ``config.json`` fields (beyond :class:`ModelConfig`) that decide whether
    we can serve the checkpoint; :meth:`parse` refuses the ones we cannot."""

    use_sliding_window: bool
    layer_types: tuple[str, ...]  # empty when the config does not list them
    hidden_act: str

    @staticmethod
    def parse(cfg: ModelConfig) -> Qwen3Options:
        """Read ``cfg.extra``; ``ValueError`` naming the field when it asks for something
        not supported (sliding windows, an activation other than SiLU)."""
        raw = cfg.extra
        options = Qwen3Options(
            use_sliding_window=bool(raw.get("use_sliding_window", False)),
            layer_types=tuple(str(t) for t in raw.get("layer_types") or ()),
            hidden_act=str(raw.get("hidden_act", "silu")),
        )
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
        if options.hidden_act != "silu":
            raise ValueError(
                f"config.json: hidden_act {options.hidden_act!r} not supported for Qwen3 (silu)"
            )
        return options


class Qwen3Attention(nn.Module):
    """QKV column-parallel → per-head RMSNorm of q and k → RoPE + K/V write → attention →
    o row-parallel. Each rank normalises its own heads (the norm never crosses heads)."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, ctx: ShardContext) -> None:
        super().__init__()
        self.qkv_proj = QKVParallelLinear(
            cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, cfg.attention_bias,
            ctx,
        )  # fmt: skip
        self.o_proj = RowParallelLinear(
            cfg.num_heads * cfg.head_dim, cfg.hidden_size, cfg.attention_bias, ctx
        )
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, ctx)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, ctx)
        self.num_heads = self.qkv_proj.num_heads  # per rank
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.head_dim = cfg.head_dim
        self.attn = Attention(layer_idx, self.num_heads, self.num_kv_heads, cfg.head_dim, ctx.ops)

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        qkv = self.qkv_proj(x)  # [T, (nh + 2 nkv) * D]
        self._normalize_heads(qkv)
        o = self.attn(qkv, batch)  # [T, nh * D]
        return self.o_proj(o)  # [T, H]

    def _normalize_heads(self, qkv: torch.Tensor) -> None:
        """RMSNorm each q and k head of ``qkv [T, (nh + 2 nkv) * D]`` in place (v untouched),
        through the backend's ``rms_norm`` on ``[T * heads, D]`` rows."""
        t, d = qkv.shape[0], self.head_dim
        q_size, kv_size = self.num_heads * d, self.num_kv_heads * d
        q = qkv[:, :q_size].reshape(t * self.num_heads, d)  # [T * nh, D] (a copy)
        k = qkv[:, q_size : q_size + kv_size].reshape(t * self.num_kv_heads, d)  # [T * nkv, D]
        qkv[:, :q_size] = self.q_norm(q)[0].view(t, q_size)
        qkv[:, q_size : q_size + kv_size] = self.k_norm(k)[0].view(t, kv_size)


class Qwen3DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, ctx: ShardContext) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ctx)
        self.self_attn = Qwen3Attention(cfg, layer_idx, ctx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ctx)
        self.mlp = LlamaMLP(cfg, ctx)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, batch: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x, residual)`` → ``(mlp_out, residual)``: the layer's output is their sum (the
        residual add fused into the following norm; layer 0 gets ``residual=None``)."""
        h, residual = self.input_layernorm(x, residual)
        h, residual = self.post_attention_layernorm(self.self_attn(h, batch), residual)
        return self.mlp(h), residual


class Qwen3Model(nn.Module):
    def __init__(
        self, cfg: ModelConfig, ctx: ShardContext, max_positions: int, partition: str = "even"
    ) -> None:
        super().__init__()
        ps = ctx.ps
        counts = cfg.layer_partition(ps.pp_size, partition)
        self.start, self.end = stage_layer_range(counts, ps.pp_rank)
        self.embed_tokens: VocabParallelEmbedding | None = None
        if ps.is_first_stage:
            self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, ctx)
        self.rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope)
        self.layers = nn.ModuleList(
            Qwen3DecoderLayer(cfg, i, ctx) if self.start <= i < self.end
            else MissingLayer()
            for i in range(cfg.num_layers)
        )  # fmt: skip
        self.norm: RMSNorm | None = None
        if ps.is_last_stage:
            self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ctx)

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """``x``: token ids ``[T]`` on stage 0, else hidden ``[T, H]``; returns ``[T, H]``."""
        if self.embed_tokens is not None:
            x = self.embed_tokens(x)  # [T, H]
        batch.rotary = self.rotary
        residual: torch.Tensor | None = None
        for i in range(self.start, self.end):
            x, residual = self.layers[i](x, residual, batch)
        return x if residual is None else x + residual


class Qwen3ForCausalLM(nn.Module):
    """HF ``Qwen3ForCausalLM``: one pipeline stage on one TP rank."""

    # checkpoint name part -> (fused parameter part, shard id)
    packed_modules_mapping: ClassVar[dict[str, tuple[str, str | int]]] = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    ignored_suffixes: ClassVar[tuple[str, ...]] = ("rotary_emb.inv_freq",)
    ignored_prefixes: ClassVar[tuple[str, ...]] = ()

    def __init__(
        self, cfg: ModelConfig, ctx: ShardContext, max_positions: int, partition: str = "even"
    ) -> None:
        """``partition``: layers per pipeline stage, see ``ModelConfig.layer_partition``.
        ``ValueError`` naming the ``config.json`` field for what Qwen3 support lacks."""
        super().__init__()
        self.options = Qwen3Options.parse(cfg)
        self.config = cfg
        self.ps = ctx.ps
        self.model = Qwen3Model(cfg, ctx, max_positions, partition)
        self.lm_head: ParallelLMHead | None = None
        if self.ps.is_last_stage:
            self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, ctx)
            if cfg.tie_word_embeddings and self.model.embed_tokens is not None:
                self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def tied_sources(self) -> dict[str, str]:
        """Parameters read from another checkpoint tensor (tied LM head); a checkpoint
        tensor of that name, if any, is ignored."""
        if self.config.tie_word_embeddings:
            return {"lm_head.weight": "model.embed_tokens.weight"}
        return {}

    def expected_checkpoint_names(self) -> set[str]:
        """Every tensor name the *whole* model (all stages) reads from a checkpoint."""
        first_local = self.model.layers[self.model.start]
        suffixes = checkpoint_names_of(first_local, self.packed_modules_mapping)
        names = {f"model.layers.{i}.{s}" for i in range(self.config.num_layers) for s in suffixes}
        names |= {"model.embed_tokens.weight", "model.norm.weight"}
        if not self.config.tie_word_embeddings:
            names.add("lm_head.weight")
        return names

    def owns(self, name: str) -> bool:
        """Whether this stage holds the checkpoint tensor ``name``."""
        parts = name.split(".")
        if len(parts) > 2 and parts[0] == "model" and parts[1] == "layers":
            return self.model.start <= int(parts[2]) < self.model.end
        if name.startswith("model.embed_tokens."):
            return self.ps.is_first_stage or (self.ps.is_last_stage and bool(self.tied_sources))
        if name.startswith(("model.norm.", "lm_head.")):
            return self.ps.is_last_stage
        return True

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        return self.model(x, batch)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Last stage only: ``hidden [N, H]`` (pre-norm) → ``logits [N, vocab]`` in the model's
        dtype."""
        assert self.model.norm is not None and self.lm_head is not None
        return self.lm_head(self.model.norm(hidden)[0])
