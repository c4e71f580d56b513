"""A plain PyTorch Llama decoder over a static KV cache: the gpt-fast recipe's model.

The same weights as the checkpoint shardserve serves (Hugging Face names, read with
``safetensors``), in the few ops a compiler sees whole: embedding, RMSNorm, rotary
(``rotate_half``, plain ``rope_theta``: no scaling), GQA attention by
``scaled_dot_product_attention`` over a cache ``[layers, B, kv_heads, max_len, head_dim]``
with a position mask, a SiLU-gated MLP; q/k/v and gate/up fused into one matrix each.
``forward`` has static shapes for a fixed ``[B, T]``, so ``torch.compile(mode=
"reduce-overhead")`` captures one decode step as one CUDA graph.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors import safe_open


@dataclass(frozen=True, slots=True)
class PlainConfig:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    eps: float
    theta: float

    @staticmethod
    def from_dir(model_dir: Path) -> PlainConfig:
        c: dict[str, Any] = json.loads((model_dir / "config.json").read_text())
        if c.get("rope_scaling") or c.get("tie_word_embeddings"):
            raise ValueError("plain Llama: no rope_scaling, an untied lm_head")
        heads = int(c["num_attention_heads"])
        return PlainConfig(
            hidden=int(c["hidden_size"]),
            layers=int(c["num_hidden_layers"]),
            heads=heads,
            kv_heads=int(c["num_key_value_heads"]),
            head_dim=int(c.get("head_dim") or c["hidden_size"] // heads),
            intermediate=int(c["intermediate_size"]),
            vocab=int(c["vocab_size"]),
            eps=float(c["rms_norm_eps"]),
            theta=float(c["rope_theta"]),
        )


def read_weights(model_dir: Path, device: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint's safetensors files, on ``device`` in ``dtype``."""
    out: dict[str, torch.Tensor] = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is no mapping)
                out[name] = f.get_tensor(name).to(device=device, dtype=dtype)
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """In float32, then back to ``x``'s dtype (as the reference backend rounds)."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x [B, T, n, D]`` rotated by ``cos, sin [T, D]`` (``rotate_half`` layout)."""
    half = x.shape[-1] // 2
    turned = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x.float() * cos[:, None] + turned.float() * sin[:, None]).to(x.dtype)


class PlainLlama(torch.nn.Module):
    """One batch of ``B`` sequences decoded in lockstep, positions shared by every row."""

    k_cache: torch.Tensor  # [layers, B, KV, max_len, D] (buffers)
    v_cache: torch.Tensor
    cos: torch.Tensor  # [max_len, D]
    sin: torch.Tensor
    positions: torch.Tensor  # [max_len]

    def __init__(
        self, cfg: PlainConfig, weights: dict[str, torch.Tensor], batch: int, max_len: int
    ) -> None:
        super().__init__()
        self.cfg = cfg
        w = weights

        def params(fmt: str, names: tuple[str, ...]) -> torch.nn.ParameterList:
            """One frozen parameter a layer: the named matrices stacked by rows."""
            rows = [torch.cat([w[fmt.format(i=i, n=n)] for n in names]) for i in range(cfg.layers)]
            return torch.nn.ParameterList(torch.nn.Parameter(t, requires_grad=False) for t in rows)

        # Parameters and buffers: static inputs, never copied, under "reduce-overhead"
        self.embed = torch.nn.Parameter(w["model.embed_tokens.weight"], requires_grad=False)
        self.head = torch.nn.Parameter(w["lm_head.weight"], requires_grad=False)  # [vocab, h]
        self.norm = torch.nn.Parameter(w["model.norm.weight"], requires_grad=False)
        attn, mlp = (
            "model.layers.{i}.self_attn.{n}_proj.weight",
            "model.layers.{i}.mlp.{n}_proj.weight",
        )
        self.qkv = params(attn, ("q", "k", "v"))  # [(H + 2 KV) * D, hidden]
        self.o = params(attn, ("o",))  # [hidden, H * D]
        self.gate_up = params(mlp, ("gate", "up"))  # [2 I, hidden]
        self.down = params(mlp, ("down",))  # [hidden, I]
        self.norm_in = params("model.layers.{i}.{n}.weight", ("input_layernorm",))
        self.norm_post = params("model.layers.{i}.{n}.weight", ("post_attention_layernorm",))
        dev, dt = self.embed.device, self.embed.dtype
        cache = (cfg.layers, batch, cfg.kv_heads, max_len, cfg.head_dim)
        self.register_buffer("k_cache", torch.zeros(cache, device=dev, dtype=dt))
        self.register_buffer("v_cache", torch.zeros(cache, device=dev, dtype=dt))
        inv = 1.0 / cfg.theta ** (torch.arange(0, cfg.head_dim, 2, device=dev) / cfg.head_dim)
        angles = torch.outer(torch.arange(max_len, device=dev, dtype=torch.float32), inv.float())
        angles = torch.cat((angles, angles), dim=-1)  # [max_len, D]
        self.register_buffer("cos", angles.cos())
        self.register_buffer("sin", angles.sin())
        self.register_buffer("positions", torch.arange(max_len, device=dev))

    def forward(self, tokens: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """``tokens [B, T]`` at positions ``pos [T]`` → logits ``[B, T, vocab]`` (float32)."""
        cfg = self.cfg
        b, t = tokens.shape
        x = self.embed[tokens]  # [B, T, hidden]
        cos, sin = self.cos[pos], self.sin[pos]  # [T, D]
        mask = self.positions[None, :] <= pos[:, None]  # [T, max_len]
        q_end, kv = cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
        for i in range(cfg.layers):
            h = rms_norm(x, self.norm_in[i], cfg.eps)
            qkv = F.linear(h, self.qkv[i])  # [B, T, (H + 2 KV) * D]
            q = rotate(qkv[..., :q_end].view(b, t, cfg.heads, cfg.head_dim), cos, sin)
            k = rotate(qkv[..., q_end : q_end + kv].view(b, t, cfg.kv_heads, -1), cos, sin)
            v = qkv[..., q_end + kv :].view(b, t, cfg.kv_heads, cfg.head_dim)
            self.k_cache[i].index_copy_(2, pos, k.transpose(1, 2))  # [B, KV, max_len, D]
            self.v_cache[i].index_copy_(2, pos, v.transpose(1, 2))
            att = F.scaled_dot_product_attention(
                q.transpose(1, 2), self.k_cache[i], self.v_cache[i], mask, enable_gqa=True
            )  # [B, H, T, D]
            x = x + F.linear(att.transpose(1, 2).reshape(b, t, q_end), self.o[i])
            h = rms_norm(x, self.norm_post[i], cfg.eps)
            gate, up = F.linear(h, self.gate_up[i]).chunk(2, dim=-1)  # [B, T, I] each
            x = x + F.linear(F.silu(gate) * up, self.down[i])
        return F.linear(rms_norm(x, self.norm, cfg.eps), self.head).float()


def greedy(model: PlainLlama, prompts: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """``prompts [B, P]`` (equal lengths) → the ``[B, new_tokens]`` greedy continuation."""
    p = prompts.shape[1]
    logits = model(prompts, torch.arange(p, device=prompts.device))
    out = [logits[:, -1].argmax(-1)]
    for step in range(1, new_tokens):
        pos = torch.tensor([p + step - 1], device=prompts.device)
        out.append(model(out[-1][:, None], pos)[:, -1].argmax(-1))
    return torch.stack(out, dim=1)
