"""A scripted cross-encoder replica: :class:`FakeEmbeddingEngine` announcing ``task="classify"``
with ``labels``, answering from the token ids alone (no model), and recording each request.

A ``score`` request gets ``[fake_score(ids)]``; a ``classify`` request gets probabilities
that put :func:`fake_label` of its ids first.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from model_shards.messages import EmbedRequest, EngineReady
from tests.server.fake_embedding_engine import FakeEmbeddingEngine


def fake_score(token_ids: list[int]) -> float:
    """Longer inputs score higher: ``len / 100``."""
    return len(token_ids) / 100


def fake_label(token_ids: list[int], num_labels: int) -> int:
    return len(token_ids) % num_labels


@dataclass
class FakeClassifierEngine(FakeEmbeddingEngine):
    labels: list[str] = field(default_factory=lambda: ["class_0"])
    received: list[EmbedRequest] = field(default_factory=list)

    def announce(self) -> EngineReady:
        return EngineReady(self.max_model_len, self.vocab_size, [], "classify", self.labels)

    def vector(self, request: EmbedRequest) -> list[float]:
        self.received.append(request)
        ids, n = request.token_ids, len(self.labels)
        if request.task == "score":
            return [fake_score(ids)]
        best = fake_label(ids, n)
        return [0.5 if i == best else 0.5 / max(n - 1, 1) for i in range(n)]
