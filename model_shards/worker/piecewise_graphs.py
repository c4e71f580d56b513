"""Mixed prefill + decode steps through piecewise graphs: everything but attention captured
once per token-count bucket, attention run eagerly between the pieces.

A step of ``T`` tokens (any mix of chunks) pads to the smallest bucket ``n >= T``
(:func:`token_buckets`), copies its ids into the static buffers, then replays piece 0,
runs attention core 0 eagerly on the ``T`` real rows with the step's own varlen metadata,
replays piece 1, and so on (:class:`~model_shards.models.piecewise.PiecewiseStack`); a
step above the largest bucket runs eagerly. ``L`` layers make ``L + 1`` graphs a bucket.
"""

from __future__ import annotations

import logging
import time
from functools import partial

import torch

from model_shards.backends.cuda.graphs import CapturedGraph, GraphBackend, bucket_for
from model_shards.layers.attention import ForwardBatch
from model_shards.models.piecewise import PiecewiseStack
from model_shards.models.stack import LayerStack

log = logging.getLogger(__name__)

SMALLEST_BUCKET = 16


def token_buckets(max_tokens: int, smallest: int = SMALLEST_BUCKET) -> list[int]:
    """Powers of two from ``smallest`` below ``max_tokens``, then ``max_tokens`` itself."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    out, n = [], smallest
    while n < max_tokens:
        out.append(n)
        n *= 2
    return [*out, max_tokens]


class PiecewiseGraphs:
    """The pieces of ``split`` captured per bucket of ``buckets`` through ``graph_backend``."""

    def __init__(
        self,
        split: PiecewiseStack,
        buckets: list[int],
        graph_backend: GraphBackend,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        if buckets != sorted(set(buckets)) or not buckets or buckets[0] < 1:
            raise ValueError(f"buckets must be distinct, ascending and >= 1: {buckets}")
        self.split, self.buckets, self.backend = split, buckets, graph_backend
        self.bufs = split.buffers(buckets[-1], device, dtype)
        self._graphs: dict[int, list[CapturedGraph]] = {}

    def capture(self) -> float:
        """Every bucket's pieces, largest bucket first; the seconds it took."""
        start = time.perf_counter()
        with torch.inference_mode():
            for n in reversed(self.buckets):
                pieces = range(self.split.num_pieces)
                self._graphs[n] = [
                    self.backend.capture(partial(self.split.piece, k, n, self.bufs)) for k in pieces
                ]
        seconds = time.perf_counter() - start
        log.info(
            "captured %d piecewise graphs (%d pieces; tokens %s) in %.1f s",
            len(self._graphs) * self.split.num_pieces,
            self.split.num_pieces,
            ", ".join(map(str, self.buckets)),
            seconds,
        )
        return seconds

    def bucket(self, num_tokens: int) -> int | None:
        """The bucket a ``num_tokens`` step replays; ``None``: it runs eagerly."""
        return bucket_for(num_tokens, self.buckets) if self._graphs else None

    def run(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor | None:
        """The stack's output ``[T, H]`` for ids (or hidden rows) ``x [T]``, replayed piece
        by piece; ``None`` when no bucket holds ``T`` (the caller runs it eagerly)."""
        t = batch.num_tokens
        n = self.bucket(t)
        if n is None:
            return None
        batch.rotary = self.split.stack.rotary
        self.bufs.ids[:t].copy_(x)
        graphs = self._graphs[n]
        for k, graph in enumerate(graphs):
            self.backend.replay(graph)
            if k < len(graphs) - 1:
                self.split.attention(k, self.bufs, batch)
        return self.bufs.out[:t]


PIECEWISE_ENV = "SHARDSERVE_PIECEWISE_GRAPHS"  # "1": capture them (off until measured on a GPU)
MAX_TOKENS = 512  # a larger step is compute-bound: its launches cost little beside it


def piecewise_for(
    model: object,
    graph_backend: GraphBackend,
    max_num_batched_tokens: int,
    device: torch.device,
    dtype: torch.dtype,
) -> PiecewiseGraphs | None:
    """Piecewise graphs of ``model``'s stack up to ``min(max_num_batched_tokens, 512)``
    tokens, or ``None`` when the stack does not split (:meth:`PiecewiseStack.of`)."""
    stack = getattr(model, "model", None)
    split = PiecewiseStack.of(stack) if isinstance(stack, LayerStack) else None
    if split is None:
        return None
    buckets = token_buckets(min(max_num_batched_tokens, MAX_TOKENS))
    return PiecewiseGraphs(split, buckets, graph_backend, device, dtype)
