"""The top-p cut from each row's largest probabilities (:mod:`model_shards.worker.top_p`)
against the full sort of the rule: the same tokens of positive probability removed on
peaked, flat, tied and top-k-cut rows; the full sort taken only when some row's cut lies
past its candidates."""

from __future__ import annotations

import pytest
import torch

from model_shards.worker import top_p
from model_shards.worker.top_p import top_p_remove

VOCAB = 400


def _rows(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Peaked rows (scale 4..8), ties (rounded to halves), a top-k-cut row (12 left), a row
    that is off and one at ``top_p = 0``; ``top_p`` in 0.3 .. 0.95."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(8, VOCAB, generator=g) * (4 + 4 * torch.rand(8, 1, generator=g))
    x[1::3] = torch.round(x[1::3] * 2) / 2
    x[5] = torch.where(x[5] >= x[5].topk(12).values[-1], x[5], float("-inf"))
    p = 0.3 + 0.65 * torch.rand(8, generator=g)
    p[6], p[7] = float("inf"), 0.0
    return x, p


def _same_draws(fast: torch.Tensor, full: torch.Tensor, x: torch.Tensor) -> bool:
    """Equal decisions on every token of positive probability (zero mass is never drawn)."""
    return not bool(((fast != full) & (x.softmax(-1) > 0)).any())


@pytest.mark.parametrize("seed", range(6))
def test_candidates_give_the_full_sorts_cut(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    x, p = _rows(seed)
    full = top_p._full_sort(x.softmax(-1), p)
    assert not full[6].any() and full[7].sum() == VOCAB - 1
    calls: list[int] = []
    real = top_p._full_sort
    monkeypatch.setattr(top_p, "_full_sort", lambda *a: calls.append(1) or real(*a))
    fast = top_p_remove(x, p, candidates=64)
    assert calls == [] and _same_draws(fast, full, x)


def test_a_flat_row_falls_back_to_the_full_sort(monkeypatch: pytest.MonkeyPatch) -> None:
    x, p = _rows(9)
    x[2] = 0.01 * torch.randn(VOCAB, generator=torch.Generator().manual_seed(1))  # flat
    calls: list[int] = []
    real = top_p._full_sort
    monkeypatch.setattr(top_p, "_full_sort", lambda *a: calls.append(1) or real(*a))
    got = top_p_remove(x, p, candidates=64)
    assert calls == [1] and torch.equal(got, real(x.softmax(-1), p))


def test_a_tie_across_the_last_candidate_is_cut_as_the_sort_cuts() -> None:
    """Twenty tokens tied where the cut falls, only some of them among the 16 candidates:
    the cut must keep the lowest ids of the tie (the stable sort's), so it falls back."""
    x = torch.full((1, VOCAB), -20.0)
    x[0, :3] = torch.tensor([5.0, 4.0, 3.0])
    x[0, 100:120] = 2.0
    p = torch.tensor([0.97])
    full = top_p._full_sort(x.softmax(-1), p)
    assert 0 < int((~full[0, 100:120]).sum()) < 20  # the cut inside the tie
    assert torch.equal(top_p_remove(x, p, candidates=16), full)
    assert torch.equal(top_p_remove(x, p, candidates=64), full)  # the whole tie inside
