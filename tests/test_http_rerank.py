"""End to end: a tiny random cross-encoder served by the real CLI; ``/v1/score``,
``/v1/rerank`` and ``/classify`` answer what transformers computes (sigmoid of the one
logit, as vLLM), and the generation and embedding routes refuse it."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import torch

from tests.live_server import live_server
from tests.model_shards.models.classifier_checkpoints import write_cross_encoder

QUERY = "what is the capital of france"
DOCS = ["paris is the capital of france", "the cat sat on the mat", "berlin"]


def _reference(model_dir: Path) -> list[float]:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(model_dir).eval()
    tok = AutoTokenizer.from_pretrained(model_dir)
    with torch.no_grad():
        batch = tok([QUERY] * len(DOCS), DOCS, padding=True, return_tensors="pt")
        return torch.sigmoid(model(**batch).logits[:, 0]).tolist()


@pytest.mark.timeout(240)
def test_cross_encoder_routes_match_transformers(tmp_path: Path) -> None:
    model_dir = write_cross_encoder(tmp_path / "ce", num_labels=1)
    reference = _reference(model_dir)
    args = ["--model", str(model_dir), "--served-model-name", "ce"]
    with live_server(args, tmp_path) as server, httpx.Client(base_url=server.url) as http:
        score = http.post("/v1/score", json={"model": "ce", "text_1": QUERY, "text_2": DOCS})
        assert score.status_code == 200, score.text
        got = [d["score"] for d in score.json()["data"]]
        assert got == pytest.approx(reference, abs=1e-5)

        rerank = http.post("/rerank", json={"query": QUERY, "documents": DOCS, "top_n": 2})
        assert rerank.status_code == 200, rerank.text
        order = sorted(range(len(DOCS)), key=lambda i: -reference[i])[:2]
        results = rerank.json()["results"]
        assert [r["index"] for r in results] == order
        assert [r["relevance_score"] for r in results] == pytest.approx(
            [reference[i] for i in order], abs=1e-5
        )

        classify = http.post("/classify", json={"input": [QUERY]})
        assert classify.status_code == 200, classify.text
        data = classify.json()["data"][0]
        assert data["label"] == "class_0" and data["num_classes"] == 1
        assert 0 < data["probs"][0] < 1

        for path, body in [
            ("/v1/embeddings", {"input": "a"}),
            ("/v1/completions", {"prompt": "a", "max_tokens": 1}),
        ]:
            refused = http.post(path, json=body)
            assert refused.status_code == 400, refused.text
            assert refused.json()["error"]["code"] == "wrong_model_task"
