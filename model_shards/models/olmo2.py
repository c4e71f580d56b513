"""OLMo 2 decoder (HF ``Olmo2ForCausalLM``), tensor- and pipeline-parallel.

Differs from Llama in two places, both read from the Hugging Face model:

* post-norms: no input norm; each sub-block's *output* is normalized before it joins the
  residual stream, ``h = x + post_attention_layernorm(attn(x))``,
  ``out = h + post_feedforward_layernorm(mlp(h))``;
* QK-norm over the whole projection: ``q_norm`` is one RMSNorm over all
  ``num_heads * head_dim`` q features (``k_norm`` over ``num_kv_heads * head_dim``),
  applied before RoPE. Under TP each rank holds only its heads, so the statistic spans
  the TP group: :class:`~model_shards.layers.sharded_norm.ShardedRMSNorm`.

RoPE, the SwiGLU MLP and the untied LM head are Llama's, and so are the checkpoint
names (:class:`~model_shards.models.llama.LlamaForCausalLM`'s fused q/k/v and gate/up).
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from model_shards.config import ModelConfig
from model_shards.layers.attention import Attention, ForwardBatch
from model_shards.layers.context import ShardContext
from model_shards.layers.linear import QKVParallelLinear, RowParallelLinear
from model_shards.layers.norm import RMSNorm
from model_shards.layers.rotary import RotaryEmbedding
from model_shards.layers.sharded_norm import ShardedRMSNorm
from model_shards.layers.vocab import ParallelLMHead, VocabParallelEmbedding
from model_shards.models.llama import LlamaForCausalLM, LlamaMLP
from model_shards.models.naming import checkpoint_names_of
from model_shards.models.stages import MissingLayer, stage_layer_range


class Olmo2Attention(nn.Module):
    """Llama attention with ``q_norm``/``k_norm`` on the (TP-split) q and k projections."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, ctx: ShardContext) -> None:
        super().__init__()
        hd = cfg.head_dim
        self.qkv_proj = QKVParallelLinear(
            cfg.hidden_size, hd, cfg.num_heads, cfg.num_kv_heads, cfg.attention_bias, ctx
        )
        self.o_proj = RowParallelLinear(
            cfg.num_heads * hd, cfg.hidden_size, cfg.attention_bias, ctx
        )
        self.q_norm = ShardedRMSNorm(cfg.num_heads, hd, cfg.rms_norm_eps, ctx)
        self.k_norm = ShardedRMSNorm(cfg.num_kv_heads, hd, cfg.rms_norm_eps, ctx)
        self.q_size = self.qkv_proj.num_heads * hd  # per rank
        self.kv_size = self.qkv_proj.num_kv_heads * hd
        self.attn = Attention(
            layer_idx, self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads, hd, ctx.ops
        )

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        qkv = self.qkv_proj(x)  # [T, (nh + 2 nkv) * D]
        q = qkv[:, : self.q_size]  # [T, nh * D] views into qkv
        k = qkv[:, self.q_size : self.q_size + self.kv_size]  # [T, nkv * D]
        q.copy_(self.q_norm(q))  # normalized in place: RoPE and the K/V write read qkv
        k.copy_(self.k_norm(k))
        o = self.attn(qkv, batch)  # [T, nh * D]
        return self.o_proj(o)  # [T, H]


class Olmo2DecoderLayer(nn.Module):
    """Post-norm block. The norms are the backend's RMSNorm (fused kernels), which rounds
    the normalized value to the dtype before the weight multiply; HF's ``Olmo2RMSNorm``
    multiplies in float32 and rounds once: the same in float32, one rounding apart in
    bfloat16."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, ctx: ShardContext) -> None:
        super().__init__()
        self.self_attn = Olmo2Attention(cfg, layer_idx, ctx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ctx)
        self.mlp = LlamaMLP(cfg, ctx)
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ctx)

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """``x: [T, H]`` → ``[T, H]``; the residual stream is explicit (no fused add)."""
        h = x + self.post_attention_layernorm(self.self_attn(x, batch))[0]  # [T, H]
        return h + self.post_feedforward_layernorm(self.mlp(h))[0]  # [T, H]


class Olmo2Model(nn.Module):
    """Layers ``[start, end)`` of this stage; embedding on the first, final norm on the last."""

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
            Olmo2DecoderLayer(cfg, i, ctx) if self.start <= i < self.end
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
        for i in range(self.start, self.end):
            x = self.layers[i](x, batch)
        return x


class Olmo2ForCausalLM(nn.Module):
    """HF ``Olmo2ForCausalLM``: Llama's checkpoint naming (q/k/v and gate/up fused; the
    ``q_norm``/``k_norm`` weights under ``self_attn``), stage ownership and logits."""

    # checkpoint name part -> (fused parameter part, shard id)
    packed_modules_mapping: ClassVar[dict[str, tuple[str, str | int]]] = (
        LlamaForCausalLM.packed_modules_mapping
    )
    ignored_suffixes: ClassVar[tuple[str, ...]] = ("rotary_emb.inv_freq",)
    ignored_prefixes: ClassVar[tuple[str, ...]] = ()

    def __init__(
        self, cfg: ModelConfig, ctx: ShardContext, max_positions: int, partition: str = "even"
    ) -> None:
        """``partition``: layers per pipeline stage, see ``ModelConfig.layer_partition``."""
        super().__init__()
        self.config = cfg
        self.ps = ctx.ps
        self.model = Olmo2Model(cfg, ctx, max_positions, partition)
        self.lm_head: ParallelLMHead | None = None
        if self.ps.is_last_stage:
            self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, ctx)
            if cfg.tie_word_embeddings and self.model.embed_tokens is not None:
                self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def tied_sources(self) -> dict[str, str]:
        """The LM head read from the embedding when tied (a checkpoint ``lm_head.weight``,
        if any, is then ignored)."""
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
        if len(parts) > 2 and parts[:2] == ["model", "layers"]:
            return self.model.start <= int(parts[2]) < self.model.end
        if name.startswith("model.embed_tokens."):
            return self.ps.is_first_stage or (self.ps.is_last_stage and bool(self.tied_sources))
        if name.startswith(("model.norm.", "lm_head.")):
            return self.ps.is_last_stage
        return True

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        return self.model(x, batch)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Last stage only: ``hidden [N, H]`` → final norm → ``logits [N, vocab]`` in the
        model's dtype."""
        assert self.model.norm is not None and self.lm_head is not None
        return self.lm_head(self.model.norm(hidden)[0])
