"""Vocabulary-parallel embedding and LM head.

The vocabulary is padded up to a multiple of ``tp`` and split into equal
contiguous ranges; rank ``r`` owns token ids ``[r * V_p, (r + 1) * V_p)``.
Padding rows are zero and never read from the checkpoint; padded logits are
cut off after the gather, so callers always see exactly ``vocab_size`` columns.

* Embedding: each rank looks up the ids it owns (zeros elsewhere); an
  all-reduce sums the partial results.
* LM head: each rank computes logits for its range; an all-gather along the
  last dim assembles them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from model_shards.layers.context import ShardContext
from model_shards.layers.linear import LinearBase, check_dim, copy_checked, set_weight_loader
from model_shards.layers.loading import load_rows, quant_of
from model_shards.parallel.comm import tp_all_gather_last_dim, tp_all_reduce
from model_shards.quant.formats import VOCAB_QUANTIZATION
from model_shards.worker.checkpoint import TensorSource


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, ctx: ShardContext) -> None:
        super().__init__()
        ps, dtype = ctx.ps, ctx.dtype
        self.ctx = ctx
        self.ps = ps
        self.vocab_size = vocab_size
        self.per_rank = -(-vocab_size // ps.tp_size)  # ceil
        self.start = ps.tp_rank * self.per_rank
        self.end = self.start + self.per_rank
        # filled by weight_loader; never touched if the table is held quantized (loading.py)
        self.weight = nn.Parameter(torch.empty(self.per_rank, hidden_size, dtype=dtype), False)
        set_weight_loader(self.weight, self.weight_loader)
        if ctx.quantization:  # --quantization: the table at 8 bits (quant.formats)
            self.weight.quantization = VOCAB_QUANTIZATION[ctx.quantization]  # type: ignore[attr-defined]

    def weight_loader(self, param: nn.Parameter, source: TensorSource) -> None:
        check_dim(source, 0, self.vocab_size)
        stop = min(self.end, self.vocab_size)
        rows = max(0, stop - self.start)
        if rows:  # held quantized: padding rows are no segment's, so zero
            load_rows(self.ctx, param, 0, source, 0, self.start, stop)
        if quant_of(param) is None:
            param.data[rows:].zero_()

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids [T]`` (local, in range) of this rank's table → ``[T, H]``."""
        quant = quant_of(self.weight)
        if quant is not None:
            return self.ctx.ops.quantized_embedding(ids, quant, self.ctx.dtype)
        return F.embedding(ids, self.weight)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.ps.tp_size == 1:
            return self.lookup(input_ids)  # [T, H]
        owned = (input_ids >= self.start) & (input_ids < self.end)
        local_ids = torch.where(owned, input_ids - self.start, 0)
        out = self.lookup(local_ids) * owned.unsqueeze(-1).to(self.ctx.dtype)
        return tp_all_reduce(out, self.ctx.comm)  # [T, H]


class ParallelLMHead(VocabParallelEmbedding, LinearBase):
    """``hidden [N, H] -> logits [N, vocab_size]``; the weight is split like the embedding's."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        local = self.gemm(hidden)  # [N, V / tp]
        full = tp_all_gather_last_dim(local, self.ctx.comm)  # [N, V_padded]
        return full[..., : self.vocab_size]


class ReplicatedEmbedding(nn.Module):
    """A small table held whole on every rank (BERT position and token-type embeddings)."""

    def __init__(self, num: int, hidden_size: int, ctx: ShardContext) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num, hidden_size, dtype=ctx.dtype), False)
        set_weight_loader(self.weight, self.weight_loader)

    def weight_loader(self, param: nn.Parameter, source: TensorSource) -> None:
        copy_checked(param.data, source.read(), source.name)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)
