"""What every decoder family's top-level class shares with the loader: the checkpoint
names of the whole model, which of them this stage holds, and the (possibly tied) LM head.

Parameter names are the checkpoint's. Decoder layer ``i`` lives under
``{layers_prefix}.{i}.``; the embedding ``embedding_name`` and ``first_stage_names`` on
the first pipeline stage; the final norm's ``last_stage_names`` and ``lm_head.weight`` on
the last. The defaults are Hugging Face Llama's names (``model.layers.{i}``,
``model.embed_tokens``, ``model.norm``); GPT-2 sets its own (``transformer.h.{i}``, …).
"""

from __future__ import annotations

from typing import ClassVar

from torch import nn

from model_shards.config.model import ModelConfig
from model_shards.layers.context import ShardContext
from model_shards.layers.vocab import ParallelLMHead, VocabParallelEmbedding
from model_shards.models.naming import checkpoint_names_of

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
