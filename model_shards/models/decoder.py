"""What a decoder model family provides: the contract the worker, the loader, the KV
sizing (:mod:`model_shards.worker.gpu_memory`) and the decode graphs rely on.

A family class (``models/llama.py``: :class:`~model_shards.models.llama.LlamaForCausalLM`)
is an ``nn.Module`` that builds one pipeline stage of the model on one TP rank; it
matches :class:`DecoderModelClass` (its constructor) and its instances match
:class:`DecoderModel`. Nothing inherits from these: they are checked structurally.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol, Self

import torch
from torch import nn

from model_shards.config.model import ModelConfig
from model_shards.layers.attention import ForwardBatch
from model_shards.layers.context import ShardContext
from model_shards.messages import SeqChunk, StepPlan
from model_shards.parallel.state import ParallelState
from model_shards.worker.loader import LoadableModel


class DecoderStack(Protocol):
    """The layer stack (``model.model``): this stage builds layers ``start .. end - 1``."""

    @property
    def start(self) -> int: ...

    @property
    def end(self) -> int: ...


class DecoderModel(LoadableModel, Protocol):
    """One pipeline stage of a causal LM on one TP rank, ready for :func:`load_weights`
    (``packed_modules_mapping``, ``owns``, ``expected_checkpoint_names``, … from
    :class:`~model_shards.worker.loader.LoadableModel`)."""

    @property
    def config(self) -> ModelConfig: ...

    @property
    def ps(self) -> ParallelState: ...

    @property
    def model(self) -> DecoderStack: ...

    @property
    def lm_head(self) -> nn.Module | None:
        """The vocab-parallel LM head: on the last stage only, else ``None``."""
        ...

    def __call__(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """``x``: token ids ``[T]`` on the first stage, else hidden ``[T, H]`` from the
        previous stage; returns this stage's hidden states ``[T, H]``."""
        ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Last stage only: ``hidden [N, H]`` → ``logits [N, vocab]`` (full vocabulary)."""
        ...

    def parameters(self) -> Iterator[nn.Parameter]: ...

    def modules(self) -> Iterator[nn.Module]: ...

    def eval(self) -> Self: ...


class StepPositions(Protocol):
    """Optional, a model's ``step_positions`` attribute: positions that are not the
    token's index in its sequence (M-RoPE: ``models/qwen2_5_vl_positions.py``). Every
    rank calls :meth:`observe` with each plan, then sets the step's
    ``ForwardBatch.rotary_rows`` to :meth:`rotary_rows` of the plan's chunks."""

    def observe(self, plan: StepPlan) -> None:
        """Forget the plan's freed sequences, take its new ones."""
        ...

    def rotary_rows(self, chunks: list[SeqChunk]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Per-token ``(cos, sin) [T, D]``, or ``None`` where the model's tables serve."""
        ...


class DecoderModelClass(Protocol):
    """A family's class: its ``config.json`` checks and its constructor."""

    def check_config(self, cfg: ModelConfig, max_model_len: int) -> None:
        """``ValueError`` naming the ``config.json`` field the family cannot serve at
        ``max_model_len`` tokens; cheap. The parent calls it before spawning any rank
        (:func:`model_shards.launch.replicas.validate_replica`); the constructor calls it again."""
        ...

    def __call__(
        self, cfg: ModelConfig, ctx: ShardContext, max_positions: int, partition: str = "even"
    ) -> DecoderModel:
        """Build this rank's stage (parameters uninitialised until loaded). ``partition``:
        layers per pipeline stage (``ModelConfig.layer_partition``)."""
        ...
