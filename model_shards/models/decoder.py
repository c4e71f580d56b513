"""The contract of a decoder family, as the worker, the loader, the KV sizing
(:mod:`model_shards.worker.gpu_memory`) and the decode graphs use it.

A family's class (:class:`DecoderModelClass`) builds one pipeline stage on one TP rank
(:class:`DecoderModel`). Nothing inherits from these protocols: they are checked
structurally.
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
    """One pipeline stage of a causal LM on one TP rank, loadable by
    :func:`~model_shards.worker.loader.load_weights`."""

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
        """Token ids ``[T]`` (first stage) or hidden ``[T, H]`` → hidden ``[T, H]``."""
        ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Last stage only: ``hidden [N, H]`` → ``logits [N, vocab]`` (full vocabulary)."""
        ...

    def parameters(self) -> Iterator[nn.Parameter]: ...

    def modules(self) -> Iterator[nn.Module]: ...

    def eval(self) -> Self: ...


class StepPositions(Protocol):
    """Optional ``step_positions`` of a model whose positions are not a token's index in
    its sequence (M-RoPE: ``models/qwen2_5_vl/positions.py``). Every rank calls
    :meth:`observe` with each plan, then sets ``ForwardBatch.rotary_rows``."""

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
        ``max_model_len`` tokens; cheap, called before any rank is spawned and again by
        the constructor."""
        ...

    def __call__(
        self, cfg: ModelConfig, ctx: ShardContext, max_positions: int, partition: str = "even"
    ) -> DecoderModel:
        """This rank's stage, parameters uninitialised until loaded (``partition``:
        ``ModelConfig.layer_partition``)."""
        ...
