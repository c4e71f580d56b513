"""DeepSeek-V2 (``DeepseekV2ForCausalLM``): multi-head latent attention and DeepSeek's MoE.

Attention (MLA), per token, ``nh`` heads (``nh / tp`` per rank), ``C = kv_lora_rank``,
``R = qk_rope_head_dim``, ``N = qk_nope_head_dim``, ``V = v_head_dim``::

    q            = q_proj(x)  or  q_b_proj(rmsnorm(q_a_proj(x)))      [nh, N + R]
    [c ; k_pe]   = kv_a_proj_with_mqa(x),  c = kv_a_layernorm(c)       [C], [R]
    k_h = [W_UK,h c ; rope(k_pe)],  v_h = W_UV,h c        kv_b_proj = [W_UK; W_UV] per head

The paged cache stores only ``[c ; rope(k_pe)]``: ``C + R`` values per token per layer
(``ModelConfig.kv_latent``: one KV "head" of ``head_dim = C + R``, K and V one buffer),
replicated on every TP rank, instead of ``2 · nh · (N + R)``. Attention absorbs the
up-projections: ``q_h · k_h = [W_UK,h^T q_nope,h ; rope(q_pe,h)] · [c ; rope(k_pe)]`` and
``Σ p v_h = W_UV,h Σ p c``, so every query (decode and prefill alike) runs as multi-query
attention of ``nh`` absorbed ``C + R``-wide heads over the latent cache
(:func:`~model_shards.layers.attention.paged_attention`, K and V the same entries), and
``W_UV`` maps the first ``C`` dims of each head's output back to ``V``. Scores are scaled
by ``(N + R)^-1/2``.

RoPE is DeepSeek's interleaved one on the ``R`` rope dims: the pairs ``(2i, 2i + 1)``
are regrouped into the half-split layout before the rotation, for ``q_pe`` and ``k_pe``
alike (a permutation applied to both leaves their dot product unchanged); its tables are
the model's (``R`` wide, any scaling of :mod:`model_shards.layers.rotary`).

MoE (:mod:`model_shards.layers.moe`): softmax scores, top-k or group-limited top-k
(``topk_method``), never renormalised, times ``routed_scaling_factor``, plus
``n_shared_experts`` shared experts as one ungated MLP (``shared_experts``); the first
``first_k_dense_replace`` layers dense. With YaRN (DeepSeek-V2's long-context RoPE) the
scores are also scaled by ``yarn_mscale(factor, mscale_all_dim)^2``, as transformers does.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from model_shards.backends.base import RotaryStep
from model_shards.config.model import ModelConfig
from model_shards.config.rope import yarn_mscale
from model_shards.layers.attention import ForwardBatch, paged_attention
from model_shards.layers.context import ShardContext
from model_shards.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from model_shards.layers.loading import keep_dense
from model_shards.layers.norm import RMSNorm
from model_shards.layers.rotary import RotaryEmbedding
from model_shards.models.causal_lm import DecoderLM
from model_shards.models.sparse_moe import ExpertLayout, experts_of

LATENT_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm: transformers' default, not the config's


def _interleaved_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """DeepSeek's RoPE of ``x [..., R]`` (pairs ``(2i, 2i+1)``), returned in the half-split
    order (evens, then odds); ``cos``/``sin`` broadcast to ``[..., R]`` float32."""
    half = torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1).float()
    r = half.shape[-1] // 2
    rotated = torch.cat((-half[..., r:], half[..., :r]), dim=-1)
    return (half * cos + rotated * sin).to(x.dtype)


class DeepseekV2Attention(nn.Module):
    """Multi-head latent attention of one layer (see the module docstring)."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, ctx: ShardContext) -> None:
        super().__init__()
        raw, h, bias = cfg.extra, cfg.hidden_size, cfg.attention_bias
        self.nope, self.rope = int(raw["qk_nope_head_dim"]), int(raw["qk_rope_head_dim"])
        self.v_dim, self.latent = int(raw["v_head_dim"]), int(raw["kv_lora_rank"])
        self.num_heads = cfg.num_heads // ctx.ps.tp_size  # per rank
        qk = self.nope + self.rope
        q_lora = raw.get("q_lora_rank")
        if q_lora is None:
            self.q_proj = ColumnParallelLinear(h, cfg.num_heads * qk, bias=False, ctx=ctx)
        else:
            self.q_a_proj = ReplicatedLinear(h, int(q_lora), bias=bias, ctx=ctx)
            self.q_a_layernorm = RMSNorm(int(q_lora), LATENT_NORM_EPS, ctx)
            self.q_b_proj = ColumnParallelLinear(
                int(q_lora), cfg.num_heads * qk, bias=False, ctx=ctx
            )
        self.kv_a_proj_with_mqa = ReplicatedLinear(h, self.latent + self.rope, bias=bias, ctx=ctx)
        self.kv_a_layernorm = RMSNorm(self.latent, LATENT_NORM_EPS, ctx)
        up = cfg.num_heads * (self.nope + self.v_dim)
        self.kv_b_proj = ColumnParallelLinear(self.latent, up, bias=False, ctx=ctx)
        keep_dense(self.kv_b_proj.weight)  # forward reads W_UK / W_UV themselves
        self.o_proj = RowParallelLinear(cfg.num_heads * self.v_dim, h, bias=bias, ctx=ctx)
        self.layer_idx, self.ops, self.scale = layer_idx, ctx.ops, qk**-0.5
        if cfg.rope.rope_type != "default" and cfg.rope.mscale_all_dim:  # YaRN's, squared
            self.scale *= yarn_mscale(cfg.rope.factor, cfg.rope.mscale_all_dim) ** 2
        width = self.latent + self.rope  # = cfg.head_dim, the latent cache entry
        # identity tables at position 0: the K/V write of rotary_and_cache rotates nothing
        self.write_cos: torch.Tensor
        self.write_sin: torch.Tensor
        self.register_buffer("write_cos", torch.ones(1, width), persistent=False)
        self.register_buffer("write_sin", torch.zeros(1, width), persistent=False)

    def _query(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "q_proj"):
            return self.q_proj(x)  # [T, nh * (N + R)]
        return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))[0])

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        t, nh, c_dim = x.shape[0], self.num_heads, self.latent
        q_nope, q_pe = self._query(x).view(t, nh, -1).split([self.nope, self.rope], dim=-1)
        c, k_pe = self.kv_a_proj_with_mqa(x).split([c_dim, self.rope], dim=-1)  # [T, C], [T, R]
        c = self.kv_a_layernorm(c.contiguous())[0]
        assert batch.rotary is not None, "the model sets the batch's rotary tables"
        cos = batch.rotary.cos_cached[batch.positions]  # [T, R]
        sin = batch.rotary.sin_cached[batch.positions]
        q_pe = _interleaved_rope(q_pe, cos[:, None], sin[:, None])  # [T, nh, R]
        k_pe = _interleaved_rope(k_pe, cos, sin)  # [T, R]
        w_kv = self.kv_b_proj.weight.view(nh, self.nope + self.v_dim, c_dim)
        q_latent = torch.einsum("thn,hnc->thc", q_nope, w_kv[:, : self.nope])  # [T, nh, C]
        entry = torch.cat((c, k_pe), dim=-1)  # [T, C + R]: what the cache holds
        q = torch.cat((q_latent, q_pe), dim=-1).reshape(t, -1)  # [T, nh * (C + R)]
        o = self._attend(torch.cat((q, entry, entry), dim=-1), batch)  # [T, nh, C + R]
        out = torch.einsum("thc,hvc->thv", o[..., :c_dim], w_kv[:, self.nope :])  # [T, nh, V]
        return self.o_proj(out.reshape(t, nh * self.v_dim))  # [T, H]

    def _attend(self, qkv: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """``qkv [T, (nh + 2) (C + R)]`` (absorbed queries, the entry as K and as V) → write
        the entries, attend (multi-query over the latent cache) → ``[T, nh, C + R]``."""
        pool = batch.kv.pools[self.layer_idx]  # k is v: [slots, 1, C + R]
        meta = batch.group(batch.kv.group_of[self.layer_idx])
        zeros = torch.zeros_like(batch.positions)
        step = RotaryStep(zeros, self.write_cos, self.write_sin, meta.slot_mapping)
        q = self.ops.rotary_and_cache(qkv, step, pool, (self.num_heads, 1))  # [T, nh, C + R]
        return paged_attention(self.ops, q, pool, meta, batch.decode_rows, self.scale)


class DeepseekV2ForCausalLM(DecoderLM):
    """HF ``DeepseekV2ForCausalLM``: one pipeline stage on one TP rank."""

    # q/k/v are not fused here (only the MLPs' gate and up are)
    packed_modules_mapping: ClassVar[dict[str, tuple[str, str | int]]] = {
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    @classmethod
    def check_config(cls, cfg: ModelConfig, max_model_len: int) -> None:
        """The MoE checks, then MLA's sizes."""
        super().check_config(cfg, max_model_len)
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            if int(cfg.extra.get(name) or 0) < 1:
                raise ValueError(f"config.json: {name} must be a positive integer")

    def __init__(
        self, cfg: ModelConfig, ctx: ShardContext, max_positions: int, partition: str = "even"
    ) -> None:
        self.check_config(cfg, max_positions)
        experts = ExpertLayout(experts_of(cfg), DeepseekV2Attention)
        # RoPE tables of the qk_rope_head_dim rope dims (the latent is not rotated)
        rotary = RotaryEmbedding(int(cfg.extra["qk_rope_head_dim"]), max_positions, cfg.rope)
        layer = experts.layer
        super().__init__(cfg, ctx, max_positions, partition, layer, rotary=rotary, experts=experts)
