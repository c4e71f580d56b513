"""Qwen2.5-VL (Hugging Face ``Qwen2_5_VLForConditionalGeneration``): the dynamic-resolution
vision tower (:mod:`model_shards.models.qwen2_5_vl.tower`) on the first pipeline stage and
a Qwen2 language model with M-RoPE, all tensor-parallel over the TP group.

Checkpoint names: transformers (4.x, and 5.x's ``save_pretrained``) writes ``visual.*``,
``model.{embed_tokens,layers,norm}.*`` and ``lm_head.weight`` (absent when tied);
transformers 5.x's in-memory spelling ``model.visual.*`` / ``model.language_model.*``
is read too. The language model is Llama's stack and layers (Qwen2: q/k/v bias, no o
bias) under Llama's names.

Images and videos: :meth:`encode_media` runs the tower over every missing item at once
(each item's flattened patches and ``grid_thw``; a video's temporal patches are the
tower's ``t``), one embedding per placeholder; the worker's
:class:`~model_shards.worker.media_inputs.MediaInputs` scatters them into the prompt's
``image_token_id`` / ``video_token_id`` positions. Positions: :attr:`step_positions`
(:class:`~model_shards.models.qwen2_5_vl.positions.MRopePositions`) on every rank gives
each step's per-token rotary rows (the three M-RoPE streams); a step of text-only
sequences uses the ordinary tables, which equal M-RoPE's for plain positions.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import ClassVar

import torch

from model_shards.config.model import ModelConfig
from model_shards.config.qwen2_5_vl import QwenVLConfig, qwen_vl_config
from model_shards.layers.context import ShardContext
from model_shards.layers.rotary import inverse_frequencies
from model_shards.messages import MediaInput
from model_shards.models.causal_lm import DecoderLM
from model_shards.models.llama import llama_attention
from model_shards.models.qwen2_5_vl.positions import MRopePositions
from model_shards.models.qwen2_5_vl.tower import QwenVisionConfig, QwenVisionTower
from model_shards.models.stack import dense_layers

VISUAL = "visual."
MEDIA_KINDS = ("image", "video")


def vision_checkpoint_names(cfg: QwenVisionConfig) -> set[str]:
    """Every ``visual.*`` tensor of the tower (the same on every stage)."""
    linear = ("weight", "bias")
    block = {"norm1.weight", "norm2.weight"}
    block |= {f"attn.{m}.{leaf}" for m in ("qkv", "proj") for leaf in linear}
    block |= {f"mlp.{m}.{leaf}" for m in ("gate_proj", "up_proj", "down_proj") for leaf in linear}
    names = {f"blocks.{i}.{n}" for i in range(cfg.depth) for n in block}
    names |= {"patch_embed.proj.weight", "merger.ln_q.weight"}
    names |= {f"merger.mlp.{i}.{leaf}" for i in (0, 2) for leaf in linear}
    return {VISUAL + n for n in names}


class Qwen2_5_VLForConditionalGeneration(DecoderLM):
    """One pipeline stage of a Qwen2.5-VL model on one TP rank."""

    checkpoint_renames: ClassVar[dict[str, str]] = {
        "model.language_model.": "model.",
        "model.visual.": VISUAL,
    }

    @classmethod
    def check_config(cls, cfg: ModelConfig, max_model_len: int) -> None:
        """Qwen2's checks (no sliding window, SiLU) and the vision config's
        (:func:`~model_shards.config.qwen2_5_vl.qwen_vl_config`); ``ValueError`` naming the
        field."""
        super().check_config(cfg, max_model_len)
        if cfg.rope.rope_type != "default":
            raise ValueError(f"config.json: rope type {cfg.rope.rope_type!r} not supported")
        qwen_vl_config(cfg.extra, cfg.head_dim)

    def __init__(
        self, cfg: ModelConfig, ctx: ShardContext, max_positions: int, partition: str = "even"
    ) -> None:
        self.check_config(cfg, max_positions)
        super().__init__(cfg, ctx, max_positions, partition, dense_layers(llama_attention))
        self.vl: QwenVLConfig = qwen_vl_config(cfg.extra, cfg.head_dim)
        self.vision_cfg = QwenVisionConfig.from_dict(dict(self.vl.vision))
        self.visual: QwenVisionTower | None = None
        if ctx.ps.is_first_stage:
            self.visual = QwenVisionTower(self.vision_cfg, ctx)
        inv_freq = inverse_frequencies(cfg.head_dim, cfg.rope)  # [D / 2]
        self.step_positions = MRopePositions(
            inv_freq, self.vl.mrope_section, self.vl.merge, self.vl.tokens_per_second, ctx.ps.device
        )

    def embed_input_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """Stage 0: ``ids [T]`` → token embeddings ``[T, H]`` (placeholder rows are replaced
        by the media's)."""
        assert self.model.embed_tokens is not None
        return self.model.embed_tokens(ids)

    def encode_media(
        self, items: Sequence[MediaInput], pixels: Sequence[torch.Tensor]
    ) -> list[torch.Tensor]:
        """Stage 0: each item's patches ``[t h w, C T P P]`` → its embeddings
        ``[t h w / m², H]``, the tower run once over all of them."""
        assert self.visual is not None
        grids = [(int(t), int(h), int(w)) for t, h, w in (i.grid_thw for i in items)]
        merged = self.visual(torch.cat(list(pixels)), grids)  # [sum t h w / m², H]
        sizes = [t * h * w // self.vl.merge**2 for t, h, w in grids]
        return list(torch.split(merged, sizes))

    def media_problem(self, item: MediaInput) -> str | None:
        """Why rank 0 refuses one media item of a request (its grid, shape or placeholder
        run do not fit this model), or ``None``."""
        if item.kind not in MEDIA_KINDS:
            return f"media kind {item.kind!r} is not image or video"
        grid = item.grid_thw
        m = self.vl.merge
        if len(grid) != 3 or any(g < 1 for g in grid) or grid[1] % m or grid[2] % m:
            return f"media grid_thw {grid} is not [t, h, w] with h and w multiples of {m}"
        if item.kind == "image" and grid[0] != 1:
            return f"an image's grid_thw {grid} must have t = 1"
        patches = grid[0] * grid[1] * grid[2]
        if item.shape != [patches, self.vision_cfg.patch_dim]:
            return f"media shape {item.shape} is not [{patches}, {self.vision_cfg.patch_dim}]"
        if item.length != self.vl.num_tokens((grid[0], grid[1], grid[2])):
            return f"media placeholder run {item.length} differs from its grid's {patches // m**2}"
        if not (math.isfinite(item.second_per_grid) and item.second_per_grid >= 0):
            return f"media second_per_grid {item.second_per_grid} must be finite and >= 0"
        return None

    def stacked_param_of(self, name: str) -> tuple[str, None] | None:
        """The tower's tensors fill the parameter of their own name (its ``gate_proj`` /
        ``up_proj`` are not the language model's fused ``gate_up_proj``)."""
        return (name, None) if name.startswith(VISUAL) else None

    def expected_checkpoint_names(self) -> set[str]:
        return super().expected_checkpoint_names() | vision_checkpoint_names(self.vision_cfg)

    def owns(self, name: str) -> bool:
        """The tower's tensors: the first stage; the rest as Qwen2's."""
        if name.startswith(VISUAL):
            return self.ps.is_first_stage
        return super().owns(name)
