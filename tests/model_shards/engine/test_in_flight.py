"""Where async scheduling runs: asked for, or by default where the backend queues device work;
never at pp > 1, for a model with images or its own position streams, or with speculation."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from model_shards.engine.in_flight import resolve_async


def _worker(queues_work: bool, pp: int = 1, media: object = None, positions: object = None) -> Any:
    ps = SimpleNamespace(pp_size=pp)
    ops = SimpleNamespace(queues_work=queues_work)
    return SimpleNamespace(ps=ps, ops=ops, media=media, positions=positions)


@pytest.mark.parametrize(
    ("asked", "queues_work", "expected"),
    [(None, True, True), (None, False, False), (True, False, True), (False, True, False)],
)
def test_default_follows_the_backend_and_the_flag_wins(
    asked: bool | None, queues_work: bool, expected: bool
) -> None:
    assert resolve_async(asked, _worker(queues_work), speculative=False) is expected


@pytest.mark.parametrize(
    "worker",
    [_worker(True, pp=2), _worker(True, media=object()), _worker(True, positions=object())],
    ids=["pp2", "images", "own-positions"],
)
def test_never_where_it_cannot_run(worker: Any) -> None:
    assert resolve_async(True, worker, speculative=False) is False
    assert resolve_async(None, worker, speculative=False) is False


def test_never_with_speculative_decoding() -> None:
    assert resolve_async(None, _worker(True), speculative=True) is False
