"""OLMo 2 decoder (HF ``Olmo2ForCausalLM``), tensor- and pipeline-parallel.

Differs from Llama in two places, both read from the Hugging Face model:

* post-norms: no input norm; each sub-block's *output* is normalized before it joins the
  residual stream, ``h = x + post_attention_layernorm(attn(x))``,
  ``out = h + post_feedforward_layernorm(mlp(h))``;
* QK-norm over the whole projection: ``q_norm`` is one RMSNorm over all
  ``num_heads * head_dim`` q features (``k_norm`` over ``num_kv_heads * head_dim``),
  applied before RoPE. Under TP each rank holds only its heads, so the statistic spans
  the TP group: :class:`~model_shards.layers.sharded_norm.ShardedRMSNorm`.

RoPE, the SwiGLU MLP, the stack and the untied LM head are Llama's, and so are the
checkpoint names (:class:`~model_shards.models.llama.LlamaForCausalLM`'s fused q/k/v and
gate/up; the ``q_norm``/``k_norm`` weights under ``self_attn``).
"""

from __future__ import annotations

import torch
from torch import nn

from model_shards.config.model import ModelConfig
from model_shards.layers.attention import ForwardBatch
from model_shards.layers.context import ShardContext
from model_shards.layers.norm import RMSNorm
from model_shards.layers.sharded_norm import ShardedRMSNorm
from model_shards.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP


class Olmo2Attention(LlamaAttention):
    """Llama attention with ``q_norm``/``k_norm`` on the (TP-split) q and k projections."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, ctx: ShardContext) -> None:
        super().__init__(cfg, layer_idx, ctx)
        hd = cfg.head_dim
        self.q_norm = ShardedRMSNorm(cfg.num_heads, hd, cfg.rms_norm_eps, ctx)
        self.k_norm = ShardedRMSNorm(cfg.num_kv_heads, hd, cfg.rms_norm_eps, ctx)
        self.q_size = self.num_heads * hd  # per rank
        self.kv_size = self.num_kv_heads * hd

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

    def forward(
        self, x: torch.Tensor, residual: None, batch: ForwardBatch
    ) -> tuple[torch.Tensor, None]:
        """``x: [T, H]`` → ``(out [T, H], None)``: the residual stream is explicit (no fused
        add), so nothing is carried to the next layer (``residual`` is always ``None``)."""
        h = x + self.post_attention_layernorm(self.self_attn(x, batch))[0]  # [T, H]
        return h + self.post_feedforward_layernorm(self.mlp(h))[0], None  # [T, H]


class Olmo2ForCausalLM(LlamaForCausalLM):
    """HF ``Olmo2ForCausalLM``: Llama's stack of :class:`Olmo2DecoderLayer`."""

    decoder_layer = Olmo2DecoderLayer
