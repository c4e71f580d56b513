"""The GPU memory a worker needs beside its KV pool, measured before the pool exists.

``KV pool = --gpu-memory-utilization × device memory − what is in use after loading
(weights, NCCL and CUDA context) − the peak of one forward at
--max-num-batched-tokens − the graph pool``, where

* the forward's peak is measured by running one prefill of that many tokens through
  this stage (sequences no longer than ``--max-model-len``, over a scratch KV pool),
  its LM head and the sampler's widest work (float32 softmax and sort of
  ``max_num_seqs`` rows), then one pass of prompt scoring
  (:mod:`~model_shards.worker.prompt_logprobs`), and reading
  ``torch.cuda.max_memory_allocated``;
* the graph pool is measured the same way for a decode step of ``max_num_seqs`` rows
  (the largest captured bucket: every graph shares that one pool), when graphs are on;
* on a vision-language model's first stage the forward's peak is the larger of the text
  forward's and the vision tower's over the largest media one step may encode
  (:func:`vision_peak_bytes`, the dummy items of
  :func:`model_shards.config.vision_budget.worst_case_media`): the tower runs before the
  stack, its activations freed before the stack's.

:func:`kv_budget_bytes` is the arithmetic, kept apart so it can be tested anywhere.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from model_shards.config.kv_layout import KVLayout
from model_shards.layers.attention import ForwardBatch
from model_shards.messages import MediaInput, SeqChunk
from model_shards.models import DecoderModel
from model_shards.worker import prompt_logprobs
from model_shards.worker.kv_cache import PagedKVCache
from model_shards.worker.media_inputs import encode_batches

log = logging.getLogger(__name__)


def kv_budget_bytes(
    utilization: float, total: int, in_use: int, forward_peak: int, graph_pool: int
) -> int:
    """Bytes left for the KV pool (may be negative: the caller reports it)."""
    return int(utilization * total) - in_use - forward_peak - graph_pool


def _scratch_chunks(
    tokens: int, max_len: int, block_size: int, groups: int
) -> tuple[list[SeqChunk], int]:
    """Prefill chunks of ``tokens`` tokens in all, each sequence at most ``max_len`` long,
    with fresh block ids (the same ones for each of ``groups`` KV groups: a scratch pool);
    and the number of blocks they use."""
    chunks, next_block, seq = [], 0, 0
    while tokens > 0:
        n = min(tokens, max_len)
        blocks = -(-n // block_size)
        ids = list(range(next_block, next_block + blocks))
        windows = [ids] * (groups - 1)
        chunks.append(SeqChunk(seq, 0, [0] * n, new_block_ids=ids, window_block_ids=windows))
        next_block, tokens, seq = next_block + blocks, tokens - n, seq + 1
    return chunks, next_block


@torch.inference_mode()
def forward_peak_bytes(
    model: DecoderModel, tokens: int, max_len: int, block_size: int, sample_rows: int
) -> int:
    """Peak bytes allocated while this stage runs one step of ``tokens`` prompt tokens
    (``max_len == 1``: a decode step of ``tokens`` rows) on a scratch KV pool."""
    device = next(model.parameters()).device
    cfg, ps = model.config, model.ps
    groups = KVLayout.for_model(cfg).num_groups
    chunks, blocks = _scratch_chunks(tokens, max_len, block_size, groups)  # max_len 1: decode
    dtype = next(model.parameters()).dtype
    layers = range(model.model.start, model.model.end)
    kv = PagedKVCache.for_stage(cfg, layers, ps.tp_size, blocks, block_size, dtype, device)
    kv.extend_tables(chunks)
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    batch = ForwardBatch.build(chunks, kv)
    x = torch.zeros(batch.num_tokens, dtype=torch.int64, device=device)
    if not ps.is_first_stage:
        x = torch.zeros(batch.num_tokens, cfg.hidden_size, dtype=dtype, device=device)
    hidden = model(x, batch)
    if model.lm_head is not None:
        logits = model.compute_logits(hidden[: min(sample_rows, hidden.shape[0])])
        logits.float().softmax(-1).sort(dim=-1, descending=True)
        del logits
        n = min(prompt_logprobs.rows_per_pass(cfg.vocab_size), hidden.shape[0])
        targets = torch.zeros(n, dtype=torch.int64, device=device)
        logits = model.compute_logits(hidden[:n]).float()
        prompt_logprobs.score_logits(logits, targets, prompt_logprobs.MAX_TOP_K)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    del kv, batch, hidden
    torch.cuda.empty_cache()
    return max(peak, 0)


def dummy_pixels(items: Sequence[MediaInput], device: torch.device) -> list[torch.Tensor]:
    """A float32 array of each item's ``shape`` (what ``media_inputs.pixels_of`` makes of
    the frontend's bytes), zeros."""
    return [torch.zeros(item.shape, dtype=torch.float32, device=device) for item in items]


def encode_dummy_media(
    model: object, items: Sequence[MediaInput], device: torch.device
) -> list[torch.Tensor]:
    """The tower over ``items`` as :class:`~model_shards.worker.media_inputs.MediaInputs` runs it
    (:func:`~model_shards.worker.media_inputs.encode_batches`); each item's embeddings
    ``[length, H]``, in order."""
    batches = encode_batches(model, items, dummy_pixels(items, device))
    by_item = {
        id(item): rows
        for done, encoded in batches
        for item, rows in zip(done, encoded, strict=True)
    }
    return [by_item[id(item)] for item in items]


@torch.inference_mode()
def vision_peak_bytes(model: DecoderModel, batches: Sequence[Sequence[MediaInput]]) -> int:
    """Peak bytes allocated while this (first) stage encodes the largest of ``batches``
    (each one tower call, pixels included), or 0 without batches."""
    device = next(model.parameters()).device
    worst = 0
    for items in batches:
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        out = encode_dummy_media(model, items, device)
        torch.cuda.synchronize(device)
        worst = max(worst, torch.cuda.max_memory_allocated(device) - base)
        del out
        torch.cuda.empty_cache()
    return worst
