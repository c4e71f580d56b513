"""A worker's decode-only steps through CUDA graphs (``cuda`` backend, unless
``--enforce-eager``): the model's forward, read from the static buffers of
:mod:`model_shards.backends.cuda.graphs`, captured once per batch bucket at start-up.

The captured forward is this stage's whole decode pass: embedding (stage 0) or the
received hidden states, every layer, and on the last stage the final norm and the LM
head, so a replay returns ``logits [B, V]`` (last stage) or ``hidden [B, H]``.
Decode attention is told each graph's static context bound (``max_blocks * block_size``,
or the smaller bounds :meth:`Backend.decode_context_bounds` asks for where attention splits
long contexts), so its launch grid is the same at every replay of that graph.
"""

from __future__ import annotations

from functools import partial

import torch

from model_shards.backends.base import Backend, DecodeMeta
from model_shards.backends.cuda.graphs import (
    DecodeInputs,
    DecodeStep,
    GraphBackend,
    GraphRunner,
    StaticDecodeInputs,
    decode_buckets,
)
from model_shards.layers.attention import ForwardBatch
from model_shards.messages import SeqChunk
from model_shards.models import DecoderModel
from model_shards.worker.kv_cache import PagedKVCache


class DecodeGraphs:
    def __init__(
        self,
        model: DecoderModel,
        kv: PagedKVCache,
        max_num_seqs: int,
        max_model_len: int,
        graph_backend: GraphBackend,
        ops: Backend | None = None,
    ) -> None:
        """``ops``: the backend whose :meth:`~Backend.decode_context_bounds` may capture a
        bucket at several context bounds (``None``: one graph per bucket)."""
        self.model, self.kv = model, kv
        ps = model.ps
        buckets = decode_buckets(max_num_seqs)
        self.max_blocks = -(-max_model_len // kv.block_size)
        hidden = None if ps.is_first_stage else model.config.hidden_size
        dtype = next(model.parameters()).dtype
        static = StaticDecodeInputs(buckets[-1], self.max_blocks, kv.device, hidden, dtype)
        self.rows = torch.arange(buckets[-1], device=kv.device)
        bounds = None
        if ops is not None:
            kv_heads = min((int(pool.k.shape[1]) for pool in kv.pools.values()), default=1)
            longest = self.max_blocks * kv.block_size
            bounds = partial(_context_bounds, ops, kv_heads=kv_heads, max_context=longest)
        self.runner = GraphRunner(
            self._forward, static, buckets, graph_backend, context_bounds=bounds
        )

    @torch.inference_mode()
    def capture(self) -> float:
        """Capture every bucket (after the weights and the KV pool exist); seconds taken."""
        return self.runner.capture_all()

    def _forward(self, inputs: DecodeInputs) -> torch.Tensor:
        n = int(inputs.positions.shape[0])
        batch = ForwardBatch(
            positions=inputs.positions,
            slot_mapping=inputs.slot_mapping,
            decode_rows=self.rows[:n],
            decode=DecodeMeta(
                inputs.block_tables,
                inputs.context_lens,
                inputs.context_bound or self.max_blocks * self.kv.block_size,
            ),
            prefill=None,
            kv=self.kv,
        )
        x = inputs.token_ids if inputs.hidden is None else inputs.hidden
        hidden = self.model(x, batch)  # [n, H]
        if self.model.lm_head is None:
            return hidden
        return self.model.compute_logits(hidden)  # [n, V]

    def run(
        self,
        chunks: list[SeqChunk],
        hidden: torch.Tensor | None,
        futures: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One decode-only step (every chunk one token): ``logits [B, V]`` on the last
        stage (a view the next step overwrites: sample it first), else ``hidden [B, H]``
        (a copy: its non-blocking send may still read it during the next replay).
        ``futures``: the previous step's sampled ids, read by token ids ``< 0``."""
        kv = self.kv
        ends = [c.start_pos + 1 for c in chunks]
        tables = [kv.table_prefix(c.seq_id, end) for c, end in zip(chunks, ends, strict=True)]
        step = DecodeStep(
            positions=[c.start_pos for c in chunks],
            slot_mapping=[kv.slot(c.seq_id, c.start_pos) for c in chunks],
            block_tables=tables,
            context_lens=ends,
            token_ids=None if hidden is not None else [c.token_ids[0] for c in chunks],
            hidden=hidden,
            future_source=futures,
        )
        out = self.runner.run(step)
        return out if self.model.lm_head is not None else out.clone()


def _context_bounds(ops: Backend, rows: int, *, kv_heads: int, max_context: int) -> list[int]:
    return ops.decode_context_bounds(rows, kv_heads, max_context)
