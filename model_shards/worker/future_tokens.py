"""Every rank's side of async scheduling: the last step's sampled ids, kept on the device where
the next step's future tokens read them (:mod:`model_shards.backends.future_tokens`)."""

from __future__ import annotations

import torch

from model_shards.messages import SeqChunk
from model_shards.parallel.comm import Comm, tp_broadcast


def has_future_tokens(chunks: list[SeqChunk]) -> bool:
    """Whether a chunk reads a token the previous step sampled (only a one-token chunk does)."""
    return any(c.token_ids[0] < 0 for c in chunks if c.token_ids)


class FutureTokens:
    """The sampled ids of the last step, for the next step's future tokens.

    The sampler (the last stage's TP rank 0) keeps its ids (:meth:`record`); the other TP ranks
    of a one-stage replica receive them in the tensor group when a step reads them
    (:meth:`source`): every rank counts the rows from the plans. Async scheduling runs at
    pipeline size 1 only, so every rank that embeds tokens is in the sampler's TP group.
    """

    def __init__(self, comm: Comm) -> None:
        self.comm = comm
        self._ids: torch.Tensor | None = None  # [S] int64 on the device (the sampler's)
        self._rows = 0

    def record(self, chunks: list[SeqChunk], sampled: torch.Tensor | None) -> None:
        """After a step over ``chunks``: how many rows it sampled, and (the sampler) its ids."""
        self._rows = sum(1 + c.num_draft for c in chunks if c.sample)
        self._ids = sampled

    def source(self, chunks: list[SeqChunk]) -> torch.Tensor | None:
        """The ids ``chunks``' future tokens read, ``None`` if none has one. A collective of the
        TP group (tp > 1) when some chunk has one: every rank calls it with the same plan."""
        if not has_future_tokens(chunks):
            return None
        ids = self._ids
        if self.comm.ps.tp_size > 1:
            if ids is None:
                ids = torch.empty(self._rows, dtype=torch.int64, device=self.comm.ps.device)
            tp_broadcast(ids, self.comm)
        if ids is None or ids.shape[0] != self._rows:
            raise RuntimeError("a plan reads sampled tokens no step before it has sampled")
        return ids
