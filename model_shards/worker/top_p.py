"""The top-p cut of a batch of rows without sorting the vocabulary.

The rule (:func:`model_shards.worker.sampler.filter_logits`, per row): ``p = softmax(x)``
sorted descending, ties by ascending token id; the token at rank ``i`` is removed when the
mass strictly before it, ``fl32(cumsum64(p)[i]) - p_i``, is ``>= top_p``; rank 0 stays.

:func:`top_p_remove` reads only the ``C`` largest probabilities of each row (``torch.topk``,
then ordered as the rule orders them): every quantity the rule computes for those ranks
is the same number here, so inside the candidates the decisions are the rule's. The ranks
past them are all removed when the first candidate tied with the last one is removed
(the mass before a later rank is at least as large, its own ``p`` no larger), or when that
last candidate has ``p = 0`` (then only tokens of zero probability lie past it, which no
draw can pick). A row meeting neither falls back, with the whole batch, to the full sort:
deciding that costs one device → host read of a flag. ``top_k`` leaves at most ``k``
positive probabilities, so rows cut to ``top_k <= C`` always take the short road.

On one device the tokens drawn are the full sort's (the CPU tests check it); on CUDA the
float64 cumulative sums of ``C`` and of ``V`` values may associate differently, a
difference far below float32 that moves a decision only at an exact rounding tie.
"""

from __future__ import annotations

import torch

CANDIDATES = 1024  # probabilities read per row before falling back to the full sort


def _cut(sorted_probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """``sorted_probs [S, n]`` (the rule's order), ``top_p [S]`` → removed ``[S, n]`` bool."""
    before = sorted_probs.double().cumsum(-1).float() - sorted_probs  # mass strictly before
    remove = before >= top_p[:, None]
    remove[:, 0] = False  # the top token stays
    return remove


def _full_sort(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """The rule itself: removed ``[S, V]`` bool."""
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True, stable=True)  # [S, V]
    return torch.zeros_like(order, dtype=torch.bool).scatter(1, order, _cut(sorted_probs, top_p))


def _candidates(probs: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``count`` largest of each row, value descending then token ascending (the full
    sort's order; ``topk`` orders ties as it likes) → ``(values, tokens) [S, count]``."""
    values, tokens = probs.topk(count, dim=-1)  # [S, C]
    tokens, by_token = tokens.sort(dim=-1)
    values = values.gather(1, by_token)
    values, by_value = values.sort(dim=-1, descending=True, stable=True)
    return values, tokens.gather(1, by_value)


def top_p_remove(
    x: torch.Tensor, top_p: torch.Tensor, candidates: int | None = None
) -> torch.Tensor:
    """``x [S, V]`` float32 logits, ``top_p [S]`` float32 (``inf``: off) → ``[S, V]`` bool,
    the tokens the rule removes (none in a row that is off); ``candidates``: ``C``, by
    default :data:`CANDIDATES`."""
    probs = x.softmax(-1)  # [S, V]
    vocab = probs.shape[-1]
    candidates = CANDIDATES if candidates is None else candidates
    if candidates >= vocab:
        return _full_sort(probs, top_p)
    values, tokens = _candidates(probs, candidates)  # [S, C]
    cut = _cut(values, top_p)  # [S, C]
    last = values[:, -1:]  # [S, 1]
    first_tied = (values == last).int().argmax(-1, keepdim=True)  # [S, 1]
    off = top_p.isinf()  # [S]
    settled = cut.gather(1, first_tied).squeeze(1) | (last.squeeze(1) == 0) | off
    if not bool(settled.all()):
        return _full_sort(probs, top_p)
    remove = torch.ones_like(probs, dtype=torch.bool).scatter(1, tokens, cut)  # [S, V]
    return remove & ~off[:, None]
