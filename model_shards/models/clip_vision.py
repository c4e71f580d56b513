"""CLIP vision tower (Hugging Face ``CLIPVisionModel``), tensor-parallel like the decoders.

Patch embedding (a stride-``p`` convolution), CLS token and learned positions, the
``pre_layrnorm``, then pre-norm encoder layers: Q/K/V column-parallel by heads,
bidirectional attention over the image's positions, ``out_proj`` row-parallel
(all-reduce), ``fc1`` column-parallel, quick-GELU, ``fc2`` row-parallel (all-reduce).
The small embedding tables are held whole on every rank. Only the encoder layers that
feed the selected ``hidden_states`` are built (``layers_run``); deeper layers and
``post_layernorm`` (the pooled output, unused by LLaVA) are in the checkpoint but read
by nobody (:func:`clip_checkpoint_names` lists them all).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from model_shards.config.vlm import VisionConfig
from model_shards.layers.context import ShardContext
from model_shards.layers.linear import (
    ColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    copy_checked,
    set_weight_loader,
)
from model_shards.layers.norm import LayerNorm
from model_shards.layers.vocab import ReplicatedEmbedding
from model_shards.worker.checkpoint import TensorSource


def activation(name: str, x: torch.Tensor) -> torch.Tensor:
    """transformers' ``ACT2FN[name]`` for the activations a LLaVA config may name."""
    if name == "quick_gelu":
        return x * torch.sigmoid(1.702 * x)
    if name == "gelu_pytorch_tanh":
        return F.gelu(x, approximate="tanh")
    return F.gelu(x)


def _replicated(shape: tuple[int, ...], ctx: ShardContext) -> nn.Parameter:
    param = nn.Parameter(torch.empty(shape, dtype=ctx.dtype), False)

    def load(p: nn.Parameter, source: TensorSource) -> None:
        copy_checked(p.data, source.read(), source.name)

    set_weight_loader(param, load)
    return param


class PatchEmbedding(nn.Module):
    """HF's ``Conv2d(C, D, p, stride=p, bias=False)``: only its ``weight [D, C, p, p]``."""

    def __init__(self, cfg: VisionConfig, ctx: ShardContext) -> None:
        super().__init__()
        shape = (cfg.hidden_size, cfg.num_channels, cfg.patch_size, cfg.patch_size)
        self.weight = _replicated(shape, ctx)


class ClipEmbeddings(nn.Module):
    def __init__(self, cfg: VisionConfig, ctx: ShardContext) -> None:
        super().__init__()
        self.patch = cfg.patch_size
        self.class_embedding = _replicated((cfg.hidden_size,), ctx)
        self.patch_embedding = PatchEmbedding(cfg, ctx)
        self.position_embedding = ReplicatedEmbedding(cfg.num_patches + 1, cfg.hidden_size, ctx)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """``pixels [N, C, S, S]`` → ``[N, 1 + P, D]`` (CLS first, positions added)."""
        weight = self.patch_embedding.weight
        patches = F.conv2d(pixels.to(weight.dtype), weight, stride=self.patch)  # [N, D, g, g]
        patches = patches.flatten(2).transpose(1, 2)  # [N, P, D]
        cls = self.class_embedding.expand(patches.shape[0], 1, -1)  # [N, 1, D]
        x = torch.cat([cls, patches], dim=1)  # [N, 1 + P, D]
        positions = torch.arange(x.shape[1], device=x.device)
        return x + self.position_embedding(positions)


class ClipAttention(nn.Module):
    def __init__(self, cfg: VisionConfig, ctx: ShardContext) -> None:
        super().__init__()
        self.qkv_proj = QKVParallelLinear(
            cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_heads, bias=True, ctx=ctx
        )
        self.out_proj = RowParallelLinear(cfg.hidden_size, cfg.hidden_size, bias=True, ctx=ctx)
        self.num_heads = self.qkv_proj.num_heads  # per rank
        self.head_dim = cfg.head_dim

    def forward(self, x: torch.Tensor, n: int) -> torch.Tensor:
        """``x [N * L, D]`` (``n`` images of ``L`` positions) → ``[N * L, D]`` (all-reduced
        over TP); each image attends to its own positions only."""
        length = x.shape[0] // n
        q, k, v = self.qkv_proj(x).chunk(3, dim=-1)  # [N L, nh * hd] each (this rank's heads)
        q, k, v = (
            t.view(n, length, self.num_heads, self.head_dim).transpose(1, 2) for t in (q, k, v)
        )
        o = F.scaled_dot_product_attention(q, k, v)  # [N, nh, L, hd], scale hd ** -0.5
        return self.out_proj(o.transpose(1, 2).reshape(n * length, self.num_heads * self.head_dim))


class ClipMLP(nn.Module):
    def __init__(self, cfg: VisionConfig, ctx: ShardContext) -> None:
        super().__init__()
        self.fc1 = ColumnParallelLinear(cfg.hidden_size, cfg.intermediate_size, bias=True, ctx=ctx)
        self.fc2 = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, bias=True, ctx=ctx)
        self.act = cfg.hidden_act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(activation(self.act, self.fc1(x)))  # [T, I / tp] → [T, D]


class ClipEncoderLayer(nn.Module):
    def __init__(self, cfg: VisionConfig, ctx: ShardContext) -> None:
        super().__init__()
        self.layer_norm1 = LayerNorm(cfg.hidden_size, cfg.layer_norm_eps, ctx)
        self.self_attn = ClipAttention(cfg, ctx)
        self.layer_norm2 = LayerNorm(cfg.hidden_size, cfg.layer_norm_eps, ctx)
        self.mlp = ClipMLP(cfg, ctx)

    def forward(self, x: torch.Tensor, n: int) -> torch.Tensor:
        """``x [N * L, D]`` → ``[N * L, D]``: pre-norm attention and MLP, residuals."""
        x = x + self.self_attn(self.layer_norm1(x), n)
        return x + self.mlp(self.layer_norm2(x))


class ClipEncoder(nn.Module):
    def __init__(self, cfg: VisionConfig, ctx: ShardContext, layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(ClipEncoderLayer(cfg, ctx) for _ in range(layers))


class ClipVisionTower(nn.Module):
    """The first ``layers_run`` encoder layers of a CLIP vision tower on one TP rank."""

    def __init__(self, cfg: VisionConfig, ctx: ShardContext, layers_run: int) -> None:
        super().__init__()
        if cfg.num_heads % ctx.ps.tp_size or cfg.intermediate_size % ctx.ps.tp_size:
            raise ValueError(
                f"vision_config: {cfg.num_heads} heads / intermediate_size "
                f"{cfg.intermediate_size} cannot be split over tp={ctx.ps.tp_size}"
            )
        self.embeddings = ClipEmbeddings(cfg, ctx)
        self.pre_layrnorm = LayerNorm(cfg.hidden_size, cfg.layer_norm_eps, ctx)  # HF's spelling
        self.encoder = ClipEncoder(cfg, ctx, layers_run)

    def forward(self, pixels: torch.Tensor, select: tuple[int, ...]) -> torch.Tensor:
        """``pixels [N, C, S, S]`` → the selected ``hidden_states`` concatenated along
        features, ``[N, 1 + P, D * len(select)]`` (``hidden_states[k]``: after ``k`` layers)."""
        x = self.pre_layrnorm(self.embeddings(pixels))  # hidden_states[0], [N, L, D]
        n, length, d = x.shape
        x = x.reshape(n * length, d)
        states = [x]
        for layer in self.encoder.layers:
            x = layer(x, n)
            states.append(x)
        return torch.cat([states[k] for k in select], dim=-1).view(n, length, -1)


def clip_checkpoint_names(prefix: str, cfg: VisionConfig) -> set[str]:
    """Every tensor a ``CLIPVisionModel`` checkpoint holds under ``prefix`` (all layers)."""
    names = {
        "embeddings.class_embedding",
        "embeddings.patch_embedding.weight",
        "embeddings.position_embedding.weight",
    }
    for norm in ("pre_layrnorm", "post_layernorm"):
        names |= {f"{norm}.weight", f"{norm}.bias"}
    per_layer = [
        f"{module}.{leaf}"
        for module in (
            "layer_norm1",
            "layer_norm2",
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "self_attn.out_proj",
            "mlp.fc1",
            "mlp.fc2",
        )
        for leaf in ("weight", "bias")
    ]
    for i in range(cfg.num_layers):
        names |= {f"encoder.layers.{i}.{s}" for s in per_layer}
    return {f"{prefix}.{n}" for n in names}
