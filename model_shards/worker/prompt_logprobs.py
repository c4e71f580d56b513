"""Prompt scoring on the last pipeline stage: the rows a plan's chunks ask to score
(:class:`~model_shards.messages.PromptScoring`) through the LM head and a float32 log-softmax.

Every TP rank of the last stage runs the head on the same rows (its vocab all-gather is a
collective); TP rank 0 keeps, per row, the target token's logprob and rank and the top ``K``
(the step's largest ``top_k``). The rows go through the head in passes of at most
``LOGITS_ELEMENTS // vocab`` rows, so a long prompt never holds ``[T, V]`` logits at once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from model_shards.messages import SeqChunk
from model_shards.models import DecoderModel

#: Most logits one pass holds (float32: 64 MiB).
LOGITS_ELEMENTS = 1 << 24
#: Most alternatives a request may ask for (the engine checks: ``request_checks.MAX_LOGPROBS``).
MAX_TOP_K = 20


def rows_per_pass(vocab_size: int) -> int:
    """Rows one LM-head pass of prompt scoring takes at most."""
    return max(1, LOGITS_ELEMENTS // vocab_size)


@dataclass
class PromptScores:
    """One step's scored rows, the scoring chunks' in plan order (CPU tensors, ``R`` rows)."""

    logprobs: torch.Tensor  # [R] float32, the target tokens'
    ranks: torch.Tensor  # [R] int64, 1 = the most likely token
    top_ids: torch.Tensor  # [R, K] int64
    top_logprobs: torch.Tensor  # [R, K] float32


def scoring_shape(chunks: list[SeqChunk]) -> tuple[int, int] | None:
    """``(R, K)``: rows a step scores and its largest ``top_k``; ``None`` if none scores."""
    scores = [c.score for c in chunks if c.score is not None]
    if not scores:
        return None
    return sum(len(s.target_ids) for s in scores), max(s.top_k for s in scores)


def score_prompts(
    model: DecoderModel, hidden: torch.Tensor, chunks: list[SeqChunk], leader: bool
) -> PromptScores | None:
    """Every last-stage TP rank: score the step's rows of ``hidden [T, H]`` (the stage output
    over ``chunks``, final norm applied). The ``leader`` (TP rank 0) gets the scores, the
    others ``None``."""
    shape = scoring_shape(chunks)
    if shape is None:
        return None
    num_rows, k = shape
    rows: list[int] = []
    targets: list[int] = []
    start = 0
    for chunk in chunks:
        if chunk.score is not None:
            first = start + chunk.score.first_row
            rows.extend(range(first, first + len(chunk.score.target_ids)))
            targets.extend(chunk.score.target_ids)
        start += len(chunk.token_ids)
    row_index = torch.tensor(rows, dtype=torch.int64, device=hidden.device)  # [R]
    target_ids = torch.tensor(targets, dtype=torch.int64, device=hidden.device)  # [R]
    per_pass = rows_per_pass(model.config.vocab_size)
    parts = []
    for lo in range(0, num_rows, per_pass):
        logits = model.compute_logits(hidden[row_index[lo : lo + per_pass]])  # [n, V]
        if leader:
            parts.append(score_logits(logits.float(), target_ids[lo : lo + per_pass], k))
    if not leader:
        return None
    logprobs, ranks, top_ids, top_logprobs = (torch.cat(p).cpu() for p in zip(*parts, strict=True))
    return PromptScores(logprobs, ranks, top_ids, top_logprobs)


def score_logits(
    logits: torch.Tensor, targets: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``logits [n, V]`` float32, ``targets [n]`` → their logprobs ``[n]``, ranks ``[n]``,
    top ``k`` ids and logprobs ``[n, k]``."""
    logp = logits.log_softmax(-1)  # [n, V]
    target = logp.gather(1, targets[:, None])  # [n, 1]
    ranks = (logp > target).sum(-1) + 1  # [n]
    top = logp.topk(k, dim=-1)
    return target[:, 0], ranks, top.indices, top.values
