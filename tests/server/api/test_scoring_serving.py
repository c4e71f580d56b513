"""``/v1/score``, ``/v1/rerank``, ``/classify`` (and the unversioned aliases) over a live
server on a fake cross-encoder replica (:mod:`tests.server.fake_classifier_engine`): pairs
tokenized with token types, vLLM's response shapes, ordering and ``top_n``, refusals as
OpenAI-style 4xx bodies, and routes a model of another task refuses."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from server.text.tokenizer import Tokenizer
from tests.model_shards.models.classifier_checkpoints import write_bert_tokenizer
from tests.server.conftest import Served, ServeFactory
from tests.server.error_body import assert_error
from tests.server.fake_classifier_engine import FakeClassifierEngine, fake_label, fake_score
from tests.server.fake_embedding_engine import FakeEmbeddingEngine
from tests.server.fake_engine import FakeEngine

pytestmark = pytest.mark.timeout(60)
QUERY = "what is the capital of france"
DOCS = ["paris", "the capital of france is paris", "a cat sat on the mat"]


@pytest.fixture(scope="module")
def bert_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return Tokenizer.from_dir(write_bert_tokenizer(Path(tmp_path_factory.mktemp("bert-tok"))))


async def serve_classifier(
    serve: ServeFactory, tokenizer: Tokenizer, labels: list[str] | None = None, **options: Any
) -> Served:
    served: Served = await serve(
        engine_class=FakeClassifierEngine,
        labels=labels or ["class_0"],
        vocab_size=tokenizer.vocab_size,
        served_tokenizer=tokenizer,
        **options,
    )
    return served


async def test_score_pairs_texts_with_token_types(
    serve: ServeFactory, bert_tokenizer: Tokenizer
) -> None:
    served = await serve_classifier(serve, bert_tokenizer)
    pairs = [bert_tokenizer.encode_pair(QUERY, doc) for doc in DOCS]
    r = await served.http.post("/v1/score", json={"text_1": QUERY, "text_2": DOCS, "model": "tiny"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and body["id"].startswith("score-")
    assert [(d["index"], d["object"]) for d in body["data"]] == [(i, "score") for i in range(3)]
    assert [d["score"] for d in body["data"]] == [fake_score(ids) for ids, _ in pairs]
    tokens = sum(len(ids) for ids, _ in pairs)
    assert body["usage"] == {
        "prompt_tokens": tokens,
        "total_tokens": tokens,
        "completion_tokens": 0,
    }
    received = served.engine.received  # type: ignore[attr-defined]
    assert [(q.token_ids, q.token_type_ids, q.task) for q in received] == [
        (ids, types, "score") for ids, types in pairs
    ]
    assert all(1 in types and types[0] == 0 for _, types in pairs)

    n_to_n = {"text_1": [QUERY, "paris"], "text_2": ["france", "berlin"]}
    r = await served.http.post("/score", json=n_to_n)
    assert r.status_code == 200, r.text
    expected = [
        bert_tokenizer.encode_pair(a, b)[0] for a, b in [(QUERY, "france"), ("paris", "berlin")]
    ]
    assert [d["score"] for d in r.json()["data"]] == [fake_score(ids) for ids in expected]


async def test_rerank_sorts_by_relevance_and_keeps_top_n(
    serve: ServeFactory, bert_tokenizer: Tokenizer
) -> None:
    served = await serve_classifier(serve, bert_tokenizer)
    scores = [fake_score(bert_tokenizer.encode_pair(QUERY, doc)[0]) for doc in DOCS]
    order = sorted(range(len(DOCS)), key=lambda i: -scores[i])
    r = await served.http.post("/v1/rerank", json={"query": QUERY, "documents": DOCS})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["id"].startswith("rerank-") and body["model"] == "tiny"
    assert [x["index"] for x in body["results"]] == order
    assert [x["relevance_score"] for x in body["results"]] == [scores[i] for i in order]
    assert [x["document"] for x in body["results"]] == [{"text": DOCS[i]} for i in order]
    assert body["usage"]["total_tokens"] > 0
    short = {"query": QUERY, "documents": DOCS, "top_n": 2, "return_documents": False}
    r = await served.http.post("/rerank", json=short)
    assert r.status_code == 200, r.text
    results = r.json()["results"]
    assert [(x["index"], x["document"]) for x in results] == [(i, None) for i in order[:2]]


async def test_classify_labels_each_input(serve: ServeFactory, bert_tokenizer: Tokenizer) -> None:
    labels = ["neg", "neutral", "pos"]
    served = await serve_classifier(serve, bert_tokenizer, labels)
    texts = ["paris", "the cat sat on the mat"]
    r = await served.http.post("/classify", json={"input": texts, "model": "tiny"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["id"].startswith("classify-")
    for i, (text, data) in enumerate(zip(texts, body["data"], strict=True)):
        ids = bert_tokenizer.encode(text)
        assert data["index"] == i and data["num_classes"] == 3 and len(data["probs"]) == 3
        assert data["label"] == labels[fake_label(ids, 3)]
    received = served.engine.received  # type: ignore[attr-defined]
    assert [(q.task, q.token_type_ids) for q in received] == [("classify", [])] * 2
    one = await served.http.post("/classify", json={"input": "paris"})
    assert one.status_code == 200 and len(one.json()["data"]) == 1
    refused = await served.http.post("/v1/score", json={"text_1": "a", "text_2": "b"})
    assert "3 labels" in assert_error(refused, 400, "model")["message"]


async def test_bad_inputs_are_400_naming_the_field(
    serve: ServeFactory, bert_tokenizer: Tokenizer
) -> None:
    served = await serve_classifier(serve, bert_tokenizer, max_model_len=16)
    long_text = " ".join(["paris"] * 40)
    cases: list[tuple[str, dict[str, Any], str | None]] = [
        ("/v1/score", {"text_1": QUERY, "text_2": []}, "text_2"),
        ("/v1/score", {"text_1": ["a", "b"], "text_2": ["a", "b", "c"]}, "text_2"),
        ("/v1/score", {"text_1": QUERY}, "text_2"),
        ("/v1/score", {"text_1": QUERY, "text_2": long_text}, "text_2"),
        (
            "/v1/score",
            {"text_1": "a", "text_2": "b", "truncate_prompt_tokens": 0},
            "truncate_prompt_tokens",
        ),
        (
            "/v1/score",
            {"text_1": "a", "text_2": "b", "truncate_prompt_tokens": 17},
            "truncate_prompt_tokens",
        ),
        ("/v1/rerank", {"query": QUERY, "documents": []}, "documents"),
        ("/v1/rerank", {"query": QUERY, "documents": ["a"], "top_n": -1}, "top_n"),
        ("/v1/rerank", {"documents": ["a"]}, "query"),
        ("/rerank", {"query": QUERY, "documents": "paris"}, "documents"),
        ("/classify", {"input": []}, "input"),
        ("/classify", {"input": [long_text]}, "input"),
        ("/classify", {"input": 5}, "input"),
    ]
    for path, body, param in cases:
        assert_error(await served.http.post(path, json=body), 400, param)
    missing = await served.http.post("/v1/score", json={"text_1": "a", "text_2": "b", "model": "x"})
    assert_error(missing, 404, "model")
    cut = {"text_1": QUERY, "text_2": long_text, "truncate_prompt_tokens": 12}
    r = await served.http.post("/v1/score", json=cut)
    assert r.status_code == 200, r.text
    ids, _ = bert_tokenizer.encode_pair(QUERY, long_text, 12)
    assert served.engine.received[-1].token_ids == ids and len(ids) == 12  # type: ignore[attr-defined]


@pytest.mark.parametrize("engine_class", [FakeEngine, FakeEmbeddingEngine])
async def test_models_of_other_tasks_refuse_the_routes(
    serve: ServeFactory, engine_class: type[FakeEngine]
) -> None:
    served = await serve(engine_class=engine_class)
    for path, body in [
        ("/v1/score", {"text_1": "a", "text_2": "b"}),
        ("/rerank", {"query": "a", "documents": ["b"]}),
        ("/classify", {"input": "a"}),
    ]:
        error = assert_error(await served.http.post(path, json=body), 400, "model")
        assert error["code"] == "wrong_model_task"


async def test_a_cross_encoder_refuses_other_routes_and_guards_its_own(
    serve: ServeFactory, bert_tokenizer: Tokenizer
) -> None:
    classifier = await serve_classifier(serve, bert_tokenizer, api_key="sekrit")
    key = {"Authorization": "Bearer sekrit"}
    for path, body in [
        ("/v1/embeddings", {"input": "a"}),
        ("/v1/completions", {"prompt": "a", "max_tokens": 1}),
    ]:
        error = assert_error(await classifier.http.post(path, json=body, headers=key), 400, "model")
        assert "cross-encoder" in error["message"]
    unkeyed = await classifier.http.post("/score", json={"text_1": "a", "text_2": "b"})
    assert_error(unkeyed, 401)
    keyed = await classifier.http.post("/score", json={"text_1": "a", "text_2": "b"}, headers=key)
    assert keyed.status_code == 200, keyed.text
