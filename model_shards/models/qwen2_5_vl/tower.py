"""Qwen2.5-VL vision tower (transformers' ``Qwen2_5_VisionTransformerPretrainedModel``),
tensor-parallel like the decoders (the first stage of ``models/qwen2_5_vl.py``).

Patch embedding (HF's ``Conv3d`` with kernel = stride = ``(T, P, P)``, i.e. a linear over
each flattened patch, held whole on every rank), the patches regrouped into windows
(:func:`~model_shards.models.qwen2_5_vl.vision.window_plan`), the axial 2D rotary from
each patch's ``(row, column)``, then pre-RMSNorm blocks: fused ``qkv`` column-parallel by
heads, bidirectional attention within each window (within each image/frame for the
``fullatt_block_indexes`` blocks), ``proj`` row-parallel (all-reduce), gated SiLU MLP
(``gate_proj``/``up_proj`` column-parallel, ``down_proj`` row-parallel). The patch merger
(``ln_q`` RMSNorm over ``m * m`` patches, ``Linear`` column-parallel, GELU, ``Linear``
row-parallel) turns each merge window into one LLM token; tokens are put back in
image order at the end. Parameter names are the checkpoint's below ``visual.``.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from model_shards.layers.context import ShardContext
from model_shards.layers.fused_sources import FusedQKVParallelLinear
from model_shards.layers.linear import ColumnParallelLinear, RowParallelLinear
from model_shards.layers.norm import RMSNorm
from model_shards.models.clip_vision import _replicated
from model_shards.models.qwen2_5_vl.vision import Grid, vision_position_ids, window_plan

RMS_EPS = 1e-6  # HF hard-codes the vision RMSNorm eps


@dataclass(frozen=True)
class QwenVisionConfig:
    """The fields of HF's ``Qwen2_5_VLVisionConfig`` the tower reads."""

    depth: int
    hidden_size: int
    num_heads: int
    intermediate_size: int
    out_hidden_size: int
    in_channels: int = 3
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    window_size: int = 112
    fullatt_block_indexes: tuple[int, ...] = (7, 15, 23, 31)
    hidden_act: str = "silu"
    rope_theta: float = 10000.0

    @staticmethod
    def from_dict(raw: dict[str, Any]) -> QwenVisionConfig:
        """From a checkpoint's ``vision_config`` dict (unknown keys ignored)."""
        rope = raw.get("rope_parameters") or {}
        fields = {k: raw[k] for k in QwenVisionConfig.__dataclass_fields__ if k in raw}
        fields["fullatt_block_indexes"] = tuple(
            fields.get("fullatt_block_indexes", (7, 15, 23, 31))
        )
        fields["rope_theta"] = float(rope.get("rope_theta", raw.get("rope_theta", 10000.0)))
        return QwenVisionConfig(**fields)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """``C * T * P * P``: one flattened patch."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2


class PatchEmbed3d(nn.Module):
    """HF's ``Conv3d(C, D, (T, P, P), stride=(T, P, P), bias=False)``: its ``weight
    [D, C, T, P, P]`` used as a linear over flattened patches."""

    def __init__(self, cfg: QwenVisionConfig, ctx: ShardContext) -> None:
        super().__init__()
        p, t = cfg.patch_size, cfg.temporal_patch_size
        self.weight = _replicated((cfg.hidden_size, cfg.in_channels, t, p, p), ctx)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """``pixels [N, C * T * P * P]`` → ``[N, D]``."""
        w = self.weight.view(self.weight.shape[0], -1)  # [D, C T P P]
        return pixels.to(w.dtype) @ w.t()


class PatchEmbed(nn.Module):
    def __init__(self, cfg: QwenVisionConfig, ctx: ShardContext) -> None:
        super().__init__()
        self.proj = PatchEmbed3d(cfg, ctx)  # HF: patch_embed.proj.weight

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.proj(pixels)


def vision_rotary(
    positions: torch.Tensor, head_dim: int, theta: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``positions [N, 2]`` (row, column) → ``(cos, sin)``, each ``[N, head_dim]`` float32:
    HF's axial rope, frequencies ``[rows | cols | rows | cols]`` of ``head_dim / 4`` each."""
    half = head_dim // 2
    inv_freq = 1.0 / (theta ** (torch.arange(0, half, 2, dtype=torch.float) / half))  # [hd/4]
    freqs = positions[..., None].float() * inv_freq  # [N, 2, hd/4]
    hw = torch.cat([freqs[:, 0], freqs[:, 1]], dim=-1)  # [N, hd/2]
    full = torch.cat([hw, hw], dim=-1)  # [N, hd]
    return full.cos(), full.sin()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x [N, nh, hd]`` rotated (rotate-half convention) in float32, back to its dtype."""
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return (xf * cos[:, None] + rotated * sin[:, None]).to(x.dtype)


class VisionAttention(nn.Module):
    def __init__(self, cfg: QwenVisionConfig, ctx: ShardContext) -> None:
        super().__init__()
        d, nh = cfg.hidden_size, cfg.num_heads
        self.qkv = FusedQKVParallelLinear(d, cfg.head_dim, nh, nh, bias=True, ctx=ctx)
        self.proj = RowParallelLinear(d, d, bias=True, ctx=ctx)
        self.num_heads = self.qkv.num_heads  # per rank
        self.head_dim = cfg.head_dim

    def forward(
        self, x: torch.Tensor, cu: list[int], rope: tuple[torch.Tensor, torch.Tensor]
    ) -> torch.Tensor:
        """``x [N, D]`` → ``[N, D]`` (all-reduced over TP); position ``i`` attends to the
        segment ``cu[j] <= i < cu[j + 1]`` holding it."""
        n = x.shape[0]
        qkv = self.qkv(x).view(n, 3, self.num_heads, self.head_dim)  # this rank's heads
        q, k = (_rotate(qkv[:, i], *rope) for i in (0, 1))  # [N, nh, hd]
        o = segment_attention(q, k, qkv[:, 2], cu).reshape(n, self.num_heads * self.head_dim)
        return self.proj(o)


def segment_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: list[int]
) -> torch.Tensor:
    """``q, k, v [N, nh, hd]`` → ``[N, nh, hd]``: bidirectional attention within each
    segment ``cu[j] .. cu[j + 1] - 1``. Segments of one length (most windows of an image
    are full-size) run as one batched SDPA: a few calls per layer, not one per window."""
    out = torch.empty_like(q)
    starts_by_length: dict[int, list[int]] = {}
    for start, end in itertools.pairwise(cu):
        if end > start:
            starts_by_length.setdefault(end - start, []).append(start)
    for length, starts in starts_by_length.items():
        rows = torch.tensor(starts, device=q.device)[:, None] + torch.arange(
            length, device=q.device
        )  # [G, L]
        qs, ks, vs = (t[rows].transpose(1, 2) for t in (q, k, v))  # [G, nh, L, hd]
        out[rows] = F.scaled_dot_product_attention(qs, ks, vs).transpose(1, 2)  # [G, L, nh, hd]
    return out


class VisionMLP(nn.Module):
    def __init__(self, cfg: QwenVisionConfig, ctx: ShardContext) -> None:
        super().__init__()
        d, i = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = ColumnParallelLinear(d, i, bias=True, ctx=ctx)
        self.up_proj = ColumnParallelLinear(d, i, bias=True, ctx=ctx)
        self.down_proj = RowParallelLinear(i, d, bias=True, ctx=ctx)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [N, D]`` → ``[N, D]``, the hidden ``[N, I / tp]``."""
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class VisionBlock(nn.Module):
    def __init__(self, cfg: QwenVisionConfig, ctx: ShardContext) -> None:
        super().__init__()
        self.norm1 = RMSNorm(cfg.hidden_size, RMS_EPS, ctx)
        self.norm2 = RMSNorm(cfg.hidden_size, RMS_EPS, ctx)
        self.attn = VisionAttention(cfg, ctx)
        self.mlp = VisionMLP(cfg, ctx)

    def forward(
        self, x: torch.Tensor, cu: list[int], rope: tuple[torch.Tensor, torch.Tensor]
    ) -> torch.Tensor:
        """``x [N, D]`` → ``[N, D]``: pre-norm attention and MLP, residuals."""
        x = x + self.attn(self.norm1(x)[0], cu, rope)
        return x + self.mlp(self.norm2(x)[0])


class PatchMerger(nn.Module):
    """``ln_q``, then ``mlp.0`` (column-parallel), GELU, ``mlp.2`` (row-parallel)."""

    def __init__(self, cfg: QwenVisionConfig, ctx: ShardContext) -> None:
        super().__init__()
        self.merged = cfg.hidden_size * cfg.spatial_merge_size**2
        self.ln_q = RMSNorm(cfg.hidden_size, RMS_EPS, ctx)
        self.mlp = nn.ModuleList(
            [
                ColumnParallelLinear(self.merged, self.merged, bias=True, ctx=ctx),
                nn.GELU(),
                RowParallelLinear(self.merged, cfg.out_hidden_size, bias=True, ctx=ctx),
            ]
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [N, D]`` (``m * m`` consecutive patches per token) → ``[N / m², out]``."""
        h = self.ln_q(x)[0].reshape(-1, self.merged)  # [N / m², D m²]
        for layer in self.mlp:
            h = layer(h)
        return h


def attention_segments(grids: list[Grid]) -> list[int]:
    """Cumulative patch counts of each frame (the full-attention blocks' segments)."""
    cu = [0]
    for t, h, w in grids:
        for _ in range(t):
            cu.append(cu[-1] + h * w)
    return cu


class QwenVisionTower(nn.Module):
    """All ``depth`` blocks and the merger of a Qwen2.5-VL vision tower on one TP rank."""

    def __init__(self, cfg: QwenVisionConfig, ctx: ShardContext) -> None:
        super().__init__()
        tp = ctx.ps.tp_size
        if cfg.num_heads % tp or cfg.intermediate_size % tp:
            raise ValueError(
                f"vision_config: {cfg.num_heads} heads / intermediate_size "
                f"{cfg.intermediate_size} cannot be split over tp={tp}"
            )
        self.cfg = cfg
        self.patch_embed = PatchEmbed(cfg, ctx)
        self.blocks = nn.ModuleList(VisionBlock(cfg, ctx) for _ in range(cfg.depth))
        self.merger = PatchMerger(cfg, ctx)

    def forward(self, pixels: torch.Tensor, grids: list[Grid]) -> torch.Tensor:
        """``pixels [N, C T P P]`` (the frontend's patches, all images concatenated, merge
        order) → ``[N / m², out_hidden_size]`` LLM embeddings, in image order."""
        cfg, unit = self.cfg, self.cfg.spatial_merge_size**2
        index, cu_windows = window_plan(
            grids, cfg.spatial_merge_size, cfg.window_size, cfg.patch_size
        )
        index = index.to(pixels.device)
        n = pixels.shape[0]

        def to_windows(t: torch.Tensor) -> torch.Tensor:  # [N, X] → [N, X], window order
            return t.reshape(n // unit, unit, -1)[index].reshape(n, -1)

        x = to_windows(self.patch_embed(pixels))  # [N, D]
        positions = vision_position_ids(grids, cfg.spatial_merge_size)  # [N, 2]
        cos, sin = vision_rotary(positions, cfg.head_dim, cfg.rope_theta)
        rope = (to_windows(cos.to(pixels.device)), to_windows(sin.to(pixels.device)))
        windows, frames = cu_windows.tolist(), attention_segments(grids)
        for i, block in enumerate(self.blocks):
            x = block(x, frames if i in cfg.fullatt_block_indexes else windows, rope)
        merged = self.merger(x)  # [N / m², out], window order
        return merged[torch.argsort(index)]
