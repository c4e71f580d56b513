"""LLaVA (Hugging Face ``LlavaForConditionalGeneration``): a CLIP vision tower, a two-layer
projector and a Llama / Mistral language model, all tensor-parallel over the TP group.

Checkpoint names are transformers': ``language_model.model.*`` / ``language_model.lm_head``
(the language model, Llama's stack and layers from :mod:`model_shards.models.llama`),
``vision_tower.*`` (:mod:`model_shards.models.clip_vision`; llava-hf's exports spell it
``vision_tower.vision_model.*``, read too) and ``multi_modal_projector.*``.
The first pipeline stage holds the tower and the projector: :meth:`encode_images` turns
an image's pixels into one embedding per placeholder token, and the worker's
:class:`~model_shards.worker.media_inputs.MediaInputs` scatters those rows into the prompt's
token embeddings (:meth:`embed_input_ids`) before the stack runs on them.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from model_shards.config.model import ModelConfig
from model_shards.config.vlm import LlavaConfig, llava_config
from model_shards.layers.attention import ForwardBatch
from model_shards.layers.context import ShardContext
from model_shards.layers.linear import ColumnParallelLinear, RowParallelLinear
from model_shards.layers.rotary import RotaryEmbedding
from model_shards.layers.vocab import ParallelLMHead
from model_shards.models.causal_lm import LM_HEAD, CausalLM, DecoderLM
from model_shards.models.clip_vision import ClipVisionTower, activation, clip_checkpoint_names
from model_shards.models.llama import llama_attention
from model_shards.models.naming import checkpoint_names_of
from model_shards.models.stack import LLAMA_PACKED, LayerStack, check_llama_config, dense_layers

VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.")


class LlavaProjector(nn.Module):
    """``linear_2(act(linear_1(x)))``: column- then row-parallel (one all-reduce)."""

    def __init__(self, llava: LlavaConfig, text_hidden: int, ctx: ShardContext) -> None:
        super().__init__()
        features = llava.vision.hidden_size * len(llava.feature_layers)
        bias = llava.projector_bias
        self.linear_1 = ColumnParallelLinear(features, text_hidden, bias=bias, ctx=ctx)
        self.linear_2 = RowParallelLinear(text_hidden, text_hidden, bias=bias, ctx=ctx)
        self.act = llava.projector_act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(activation(self.act, self.linear_1(x)))  # [T, F] → [T, H]


class LanguageModel(nn.Module):
    """HF's ``language_model`` (a ``LlamaForCausalLM``): this stage's stack and the head."""

    def __init__(self, stack: LayerStack, head: ParallelLMHead | None) -> None:
        super().__init__()
        self.model = stack
        self.lm_head = head


class LlavaForConditionalGeneration(CausalLM):
    """One pipeline stage of a LLaVA model on one TP rank."""

    packed_modules_mapping: ClassVar[dict[str, tuple[str, str | int]]] = LLAMA_PACKED
    ignored_suffixes: ClassVar[tuple[str, ...]] = DecoderLM.ignored_suffixes
    layers_prefix: ClassVar[str] = "language_model.model.layers"
    embedding_name: ClassVar[str] = "language_model.model.embed_tokens.weight"
    last_stage_names: ClassVar[tuple[str, ...]] = ("language_model.model.norm.weight",)
    lm_head_name: ClassVar[str] = "language_model.lm_head.weight"
    # llava-hf's checkpoints (older transformers) keep CLIPVisionModel's inner module name
    checkpoint_renames: ClassVar[dict[str, str]] = {"vision_tower.vision_model.": "vision_tower."}

    def __init__(
        self, cfg: ModelConfig, ctx: ShardContext, max_positions: int, partition: str = "even"
    ) -> None:
        self.check_config(cfg, max_positions)
        super().__init__(cfg, ctx)
        self.llava = llava_config(cfg.extra)
        rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope)
        stack = LayerStack(cfg, ctx, dense_layers(llama_attention), rotary, partition)
        self.language_model = LanguageModel(stack, self.build_lm_head(ctx, stack.embed_tokens))
        self.vision_tower: ClipVisionTower | None = None
        self.multi_modal_projector: LlavaProjector | None = None
        self._vision_names: set[str] = set()
        if ctx.ps.is_first_stage:
            self.vision_tower = ClipVisionTower(self.llava.vision, ctx, self.llava.layers_run)
            self.multi_modal_projector = LlavaProjector(self.llava, cfg.hidden_size, ctx)
            for prefix in ("vision_tower", "multi_modal_projector"):
                module = self.get_submodule(prefix)
                parts = checkpoint_names_of(module, self.packed_modules_mapping)
                self._vision_names |= {f"{prefix}.{n}" for n in parts}

    @classmethod
    def check_config(cls, cfg: ModelConfig, max_model_len: int) -> None:
        """The language model's checks (Llama's) and the vision config's
        (:func:`~model_shards.config.vlm.llava_config`); ``ValueError`` naming the field."""
        check_llama_config(cfg, max_model_len)
        llava_config(cfg.extra)

    @property
    def model(self) -> LayerStack:
        """The language model's stack (``language_model.model``)."""
        return self.language_model.model

    @property
    def lm_head(self) -> ParallelLMHead | None:
        return self.language_model.lm_head

    def stage_layers(self) -> range:
        return range(self.model.start, self.model.end)

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """``x``: input embeddings ``[T, H]`` (or token ids ``[T]``) on stage 0, else the
        previous stage's hidden ``[T, H]``; returns ``[T, H]``."""
        return self.model(x, batch)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Last stage only: ``hidden [N, H]`` (the final norm's output) → ``logits [N, vocab]``."""
        assert self.lm_head is not None
        return self.lm_head(hidden)

    def embed_input_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """Stage 0: ``ids [T]`` → token embeddings ``[T, H]`` (an image token id past the
        vocabulary embeds as id 0; its rows are replaced by the image's)."""
        assert self.model.embed_tokens is not None
        ids = torch.where(ids < self.config.vocab_size, ids, torch.zeros_like(ids))
        return self.model.embed_tokens(ids)

    def encode_images(self, pixels: torch.Tensor) -> torch.Tensor:
        """Stage 0: ``pixels [N, C, S, S]`` → ``[N, tokens_per_image, H]``, the rows that
        replace each image's placeholder tokens."""
        assert self.vision_tower is not None and self.multi_modal_projector is not None
        feats = self.vision_tower(pixels, self.llava.feature_layers)  # [N, 1 + P, F]
        if self.llava.select_strategy == "default":
            feats = feats[:, 1:]  # drop CLS
        n, p, f = feats.shape
        return self.multi_modal_projector(feats.reshape(n * p, f)).view(n, p, -1)

    @property
    def tied_sources(self) -> dict[str, str]:
        return {self.lm_head_name: self.embedding_name} if self.config.tie_word_embeddings else {}

    def expected_checkpoint_names(self) -> set[str]:
        names = super().expected_checkpoint_names() - {LM_HEAD}
        if not self.config.tie_word_embeddings:
            names.add(self.lm_head_name)
        names |= clip_checkpoint_names("vision_tower", self.llava.vision)
        projector = ("linear_1", "linear_2")
        leaves = ("weight", "bias") if self.llava.projector_bias else ("weight",)
        names |= {f"multi_modal_projector.{m}.{leaf}" for m in projector for leaf in leaves}
        return names

    def owns(self, name: str) -> bool:
        """Vision tensors: the first stage, those of layers it runs (not deeper layers nor
        ``post_layernorm``); the LM head: the last stage; the rest as a decoder's."""
        if name.startswith(VISION_PREFIXES):
            return name in self._vision_names
        if name == self.lm_head_name:
            return self.ps.is_last_stage
        return super().owns(name)
