"""The decoder every rotary family assembles: this stage's layer stack, the pre-norm layer,
and the ``config.json`` checks of Llama's layers.

Parameter names are Hugging Face Llama's: ``model.embed_tokens`` (first stage),
``model.layers.{i}.…`` (layers ``[start, end)`` of this stage; the others are
:class:`~model_shards.models.stages.MissingLayer` placeholders), ``model.norm`` (last stage).
"""

from __future__ import annotations

import torch
from torch import nn

from model_shards.backends.decode_stack import DecodeLayerParts
from model_shards.config.kv_layout import WINDOWED_ARCHITECTURES
from model_shards.config.model import ModelConfig
from model_shards.layers.attention import ForwardBatch
from model_shards.layers.context import ShardContext
from model_shards.layers.mlp import GatedMLP
from model_shards.layers.norm import RMSNorm
from model_shards.layers.rotary import RotaryEmbedding
from model_shards.layers.vocab import VocabParallelEmbedding
from model_shards.models.plain_decode import PlainDecode, plain_layer_parts
from model_shards.models.stages import LayerFactory, stage_layers

# checkpoint name part -> (fused parameter part, shard id): q/k/v and gate/up, Llama's
LLAMA_PACKED: dict[str, tuple[str, str | int]] = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class DecoderLayer(nn.Module):
    """Pre-norm layer: ``h = x + self_attn(norm(x))``, ``out = h + ffn(norm(h))``, the
    feed-forward under ``ffn_name`` (``mlp``; Mixtral's ``block_sparse_moe``).

    ``(x, residual)`` → ``(ffn_out, residual)``, the layer's output their sum: each residual
    add is fused into the next norm (vLLM's layout); layer 0 gets ``residual=None``.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        ctx: ShardContext,
        self_attn: nn.Module,
        ffn: nn.Module,
        ffn_name: str = "mlp",
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ctx)
        self.self_attn = self_attn
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ctx)
        self.ffn_name = ffn_name
        self.add_module(ffn_name, ffn)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, batch: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = self.input_layernorm(x, residual)
        h, residual = self.post_attention_layernorm(self.self_attn(h, batch), residual)
        ffn: nn.Module = getattr(self, self.ffn_name)
        return ffn(h), residual

    def decode_parts(self) -> DecodeLayerParts | None:
        """This layer for a backend's whole-step decode (:mod:`.plain_decode`); ``None``
        unless it is plain."""
        norms = (self.input_layernorm, self.post_attention_layernorm)
        return plain_layer_parts(*norms, self.self_attn, getattr(self, self.ffn_name))


def dense_layers(attention: LayerFactory) -> LayerFactory:
    """Pre-norm layers of ``attention`` and a SiLU :class:`GatedMLP` (``intermediate_size``)."""

    def layer(cfg: ModelConfig, layer_idx: int, ctx: ShardContext) -> DecoderLayer:
        mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, ctx)
        return DecoderLayer(cfg, ctx, attention(cfg, layer_idx, ctx), mlp)

    return layer


class LayerStack(nn.Module):
    """This stage's layers ``[start, end)`` (``layer``: any ``(x, residual, batch) ->
    (x, residual)`` module; one that adds its own residual returns ``(out, None)``), the
    embedding on the first stage, the final norm on the last. ``rotary``: the tables every
    layer's attention reads from the batch; ``norm_class``: the final norm's (Gemma's
    ``1 + w``); ``embed_scale``: what the embeddings are multiplied by (Gemma), if any."""

    def __init__(
        self,
        cfg: ModelConfig,
        ctx: ShardContext,
        layer: LayerFactory,
        rotary: RotaryEmbedding,
        partition: str = "even",
        *,
        norm_class: type[RMSNorm] = RMSNorm,
        embed_scale: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        ps = ctx.ps
        self.start, self.end, self.layers = stage_layers(cfg, ctx, partition, layer)
        self.embed_tokens: VocabParallelEmbedding | None = None
        if ps.is_first_stage:
            self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, ctx)
        self.rotary = rotary
        self.norm: RMSNorm | None = None
        if ps.is_last_stage:
            self.norm = norm_class(cfg.hidden_size, cfg.rms_norm_eps, ctx)
        self.embed_scale = embed_scale
        self.plain_decode = PlainDecode(ctx, self.layers, self.start, self.end)

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """``x``: token ids ``[T]``, or input embeddings ``[T, H]`` (a vision-language
        model's, images scattered in), on stage 0; else hidden ``[T, H]``. → ``[T, H]``:
        the hidden rows a next stage takes, or on the last stage the final norm's output
        (what the LM head reads)."""
        if self.embed_tokens is not None and not x.is_floating_point():
            x = self.embed_tokens(x)  # [T, H]
            if self.embed_scale is not None:
                x = x * self.embed_scale
        batch.rotary = self.rotary
        residual: torch.Tensor | None = None
        whole_step = self.plain_decode.run(x, batch)
        if whole_step is not None:
            x = whole_step
        else:
            for i in range(self.start, self.end):
                x, residual = self.layers[i](x, residual, batch)
        return self.finish(x, residual)

    def finish(self, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        """The stage's output from the last layer's ``(x, residual)``: ``x + residual`` on a
        stage that sends it on, the final norm of that sum on the last stage (one fused
        add + RMSNorm: the same bits as the add, then the norm)."""
        if self.norm is not None:
            return self.norm(x, residual)[0]  # [T, H]
        return x if residual is None else x + residual


def check_llama_config(cfg: ModelConfig, max_model_len: int) -> None:
    """``ValueError`` naming the ``config.json`` field a model of Llama's layers cannot serve
    at ``max_model_len`` tokens: an activation other than SiLU, a window not served."""
    act = str(cfg.extra.get("hidden_act", "silu"))
    if act != "silu":
        raise ValueError(
            f"config.json: hidden_act {act!r} not supported for {cfg.architecture} (silu)"
        )
    check_no_window(cfg, max_model_len)


def check_no_window(cfg: ModelConfig, max_model_len: int) -> None:
    """For a family whose windows are not served (``kv_layout.WINDOWED_ARCHITECTURES``
    are): ``ValueError`` unless sliding-window attention would change nothing: Qwen's
    ``use_sliding_window`` off (then its ``sliding_window`` is unused), else any
    ``sliding_window`` at least ``max_model_len`` (a sequence no longer than the window
    attends to all of it)."""
    if cfg.architecture in WINDOWED_ARCHITECTURES:
        return
    if "use_sliding_window" in cfg.extra:  # Qwen2 / Qwen3: the window applies only when on
        if cfg.extra["use_sliding_window"]:
            raise ValueError(
                "config.json: use_sliding_window is true; sliding-window attention is not "
                "supported yet"
            )
        return
    window = cfg.extra.get("sliding_window")
    if window is not None and window < max_model_len:
        raise ValueError(
            f"config.json: sliding_window {window} is shorter than the {max_model_len}-token "
            f"context; sliding-window attention is not supported yet: serve with "
            f"--max-model-len {window}"
        )
