"""The top-level class of a decoder family: :class:`CausalLM`, what every family shares
with the loader, and :class:`DecoderLM`, the causal LM over a
:class:`~model_shards.models.stack.LayerStack` that the rotary families build.

Parameter names are the checkpoint's. Decoder layer ``i`` lives under
``{layers_prefix}.{i}.``; the embedding ``embedding_name`` and ``first_stage_names`` on
the first pipeline stage; the final norm's ``last_stage_names`` and ``lm_head.weight`` on
the last. The defaults are Hugging Face Llama's names (``model.layers.{i}``,
``model.embed_tokens``, ``model.norm``); GPT-2 sets its own (``transformer.h.{i}``, …).
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from model_shards.config.model import ModelConfig
from model_shards.config.moe import moe_config
from model_shards.layers.attention import ForwardBatch
from model_shards.layers.context import ShardContext
from model_shards.layers.norm import RMSNorm
from model_shards.layers.rotary import RotaryEmbedding
from model_shards.layers.vocab import ParallelLMHead, VocabParallelEmbedding
from model_shards.models.naming import checkpoint_names_of
from model_shards.models.sparse_moe import ExpertLayout
from model_shards.models.stack import LLAMA_PACKED, LayerStack, check_llama_config
from model_shards.models.stages import LayerFactory

LM_HEAD = "lm_head.weight"


class CausalLM(nn.Module):
    """One pipeline stage of a causal LM on one TP rank, as the loader sees it.

    A family subclass builds its layer stack and its head (:meth:`build_lm_head`) and says
    which layers this stage built (:meth:`stage_layers`); the class attributes say where
    its tensors sit in the checkpoint.
    """

    # checkpoint name part -> (fused parameter part, shard id)
    packed_modules_mapping: ClassVar[dict[str, tuple[str, str | int]]] = {}
    # checkpoint tensors that carry no weights
    ignored_suffixes: ClassVar[tuple[str, ...]] = ()
    ignored_prefixes: ClassVar[tuple[str, ...]] = ()
    layers_prefix: ClassVar[str] = "model.layers"  # also the ModuleList's path
    embedding_name: ClassVar[str] = "model.embed_tokens.weight"  # the tied head's source
    first_stage_names: ClassVar[tuple[str, ...]] = ()  # besides the embedding
    last_stage_names: ClassVar[tuple[str, ...]] = ("model.norm.weight",)  # besides the head

    def __init__(self, cfg: ModelConfig, ctx: ShardContext) -> None:
        super().__init__()
        self.config = cfg
        self.ps = ctx.ps

    def stage_layers(self) -> range:
        """The decoder layers this stage built, ``range(start, end)``."""
        raise NotImplementedError

    def build_lm_head(
        self, ctx: ShardContext, embedding: VocabParallelEmbedding | None
    ) -> ParallelLMHead | None:
        """The last stage's vocab-parallel LM head (``None`` elsewhere). Tied: the same
        parameter as ``embedding`` where this stage holds it (pp = 1), else read from the
        embedding's checkpoint tensor (:attr:`tied_sources`)."""
        if not self.ps.is_last_stage:
            return None
        head = ParallelLMHead(self.config.vocab_size, self.config.hidden_size, ctx)
        if self.config.tie_word_embeddings and embedding is not None:
            head.weight = embedding.weight
        return head

    @property
    def tied_sources(self) -> dict[str, str]:
        """Parameters read from another checkpoint tensor (tied LM head); a checkpoint
        tensor of that name, if any, is ignored."""
        return {LM_HEAD: self.embedding_name} if self.config.tie_word_embeddings else {}

    def expected_checkpoint_names(self) -> set[str]:
        """Every tensor name the *whole* model (all stages) reads from a checkpoint."""
        first_local = self.get_submodule(f"{self.layers_prefix}.{self.stage_layers().start}")
        suffixes = checkpoint_names_of(first_local, self.packed_modules_mapping)
        layers = range(self.config.num_layers)
        names = {f"{self.layers_prefix}.{i}.{s}" for i in layers for s in suffixes}
        names |= {self.embedding_name, *self.first_stage_names, *self.last_stage_names}
        if not self.config.tie_word_embeddings:
            names.add(LM_HEAD)
        return names

    def layer_index(self, name: str) -> int | None:
        """The decoder layer a checkpoint name belongs to, or ``None``."""
        head, dot, rest = name.partition(f"{self.layers_prefix}.")
        return int(rest.split(".", 1)[0]) if dot and not head else None

    def owns(self, name: str) -> bool:
        """Whether this stage holds the checkpoint tensor ``name`` (one it expects)."""
        layer = self.layer_index(name)
        if layer is not None:
            return layer in self.stage_layers()
        if name == self.embedding_name:
            return self.ps.is_first_stage or (self.ps.is_last_stage and bool(self.tied_sources))
        if name in self.first_stage_names:
            return self.ps.is_first_stage
        if name == LM_HEAD or name in self.last_stage_names:
            return self.ps.is_last_stage
        return True


class DecoderLM(CausalLM):
    """A causal LM of Llama's layout: ``model`` (this stage's :class:`LayerStack` of
    ``layer``) and ``lm_head``. ``rotary``: the model's RoPE tables (default: the config's
    over ``head_dim``, positions ``0 .. max_positions - 1``); ``experts``: a MoE family's
    layout, which the loader's hooks below follow; ``norm_class``, ``embed_scale``: the
    stack's."""

    packed_modules_mapping: ClassVar[dict[str, tuple[str, str | int]]] = LLAMA_PACKED
    # checkpoint tensors that carry no weights (older HF exports)
    ignored_suffixes: ClassVar[tuple[str, ...]] = ("rotary_emb.inv_freq",)

    def __init__(
        self,
        cfg: ModelConfig,
        ctx: ShardContext,
        max_positions: int,
        partition: str,
        layer: LayerFactory,
        *,
        rotary: RotaryEmbedding | None = None,
        experts: ExpertLayout | None = None,
        norm_class: type[RMSNorm] = RMSNorm,
        embed_scale: torch.Tensor | None = None,
    ) -> None:
        super().__init__(cfg, ctx)
        if rotary is None:
            rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope)
        self.model = LayerStack(
            cfg, ctx, layer, rotary, partition, norm_class=norm_class, embed_scale=embed_scale
        )
        self.lm_head = self.build_lm_head(ctx, self.model.embed_tokens)
        self.expert_layout = experts

    @classmethod
    def check_config(cls, cfg: ModelConfig, max_model_len: int) -> None:
        """``ValueError`` naming the ``config.json`` field the layers cannot serve: Llama's
        checks (:func:`~model_shards.models.stack.check_llama_config`) and a mixture of
        experts' fields. A family adds its own (or, with other layers, replaces these)."""
        check_llama_config(cfg, max_model_len)
        moe = moe_config(cfg)  # None: a dense architecture
        if moe is not None:
            moe.check()

    def stage_layers(self) -> range:
        return range(self.model.start, self.model.end)

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        return self.model(x, batch)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Last stage only: ``hidden [N, H]`` (rows of :meth:`forward`'s output, final norm
        applied) → ``logits [N, vocab]`` in the model's dtype (the sampler widens them to
        float32 only where a row needs more than argmax)."""
        assert self.lm_head is not None
        return self.lm_head(hidden)

    def stacked_param_of(self, name: str) -> tuple[str, tuple[int, str] | None] | None:
        """The loader's hook: an expert's tensor → the stacked parameter it fills."""
        layout = self.expert_layout
        return None if layout is None else layout.stacked_param_of(name)

    def expected_checkpoint_names(self) -> set[str]:
        names, layout = super().expected_checkpoint_names(), self.expert_layout
        if layout is None:
            return names
        return layout.checkpoint_names(names, self.layers_prefix, self.config.num_layers)
