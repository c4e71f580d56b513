"""Cross-encoders (``BertForSequenceClassification``) through the replica machinery equal
transformers: tiny random checkpoints (:mod:`.classifier_checkpoints`) run through
:class:`EncoderWorker` and :class:`EmbeddingCoordinator` at tp=1 and tp=2 (one gloo world per
layout serving both checkpoints). ``score`` on text pairs (token types 1 on the second text)
and ``classify`` on single texts match the activations vLLM applies to transformers' logits;
the frontend tokenizer's pair encoding equals transformers'.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from model_shards.config.encoder import EncoderConfig
from model_shards.config.replica import ReplicaConfig
from model_shards.engine.embedding_coordinator import EmbeddingCoordinator
from model_shards.messages import EmbedRequest
from model_shards.parallel.comm import Comm
from model_shards.worker.encoder_worker import EncoderWorker
from server.text.tokenizer import Tokenizer
from tests.model_shards.models.classifier_checkpoints import write_cross_encoder
from tests.world import run_world

QUERY = "what is the capital of france"
DOCS = ["paris is the capital of france", "the cat sat on the mat", "berlin", "rivers split"]
TEXTS = ["the dog sat on the mat", "tensor parallel split weight matrix", "paris"]
IDENTITY = "torch.nn.modules.linear.Identity"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """One label scored raw (the Identity activation), and three labels (softmax)."""
    root = tmp_path_factory.mktemp("cross-encoders")
    one = write_cross_encoder(root / "one", num_labels=1, activation_fn=IDENTITY)
    three = write_cross_encoder(root / "three", num_labels=3, seed=1)
    return [str(one), str(three)]


def _requests(model_dir: str) -> list[EmbedRequest]:
    """Score each (QUERY, doc) pair on a one-label model; classify each text on any model."""
    tok = Tokenizer.from_dir(model_dir)
    out = []
    if EncoderConfig.from_dir(model_dir).head.num_labels == 1:  # type: ignore[union-attr]
        for i, doc in enumerate(DOCS):
            ids, types = tok.encode_pair(QUERY, doc)
            out.append(EmbedRequest(f"s{i}", ids, types, task="score"))
    for i, text in enumerate(TEXTS):
        out.append(EmbedRequest(f"c{i}", tok.encode(text), task="classify"))
    return out


def _rank(peers: Comm, model_dirs: list[str], out: str) -> None:
    results = {}
    for model_dir in model_dirs:
        cfg = EncoderConfig.from_dir(model_dir)
        worker = EncoderWorker.build(ReplicaConfig(model_dir, dtype="float32"), cfg, peers)
        if peers.ps.rank != 0:
            worker.serve_forever()
            continue
        coord = EmbeddingCoordinator(
            worker, max_num_seqs=8, max_num_batched_tokens=4096, max_model_len=cfg.max_seq_length
        )
        requests = _requests(model_dir)
        assert all(coord.check_request(r) is None for r in requests)
        results[model_dir] = coord.pool(requests)
        coord.shutdown()
    if peers.ps.rank == 0:
        Path(out).write_text(json.dumps(results))


def _reference(model_dir: str) -> list[list[float]]:
    """transformers' logits through vLLM's activations: the score as the checkpoint's
    sentence-transformers activation (Identity here) names; classify: sigmoid for one
    label, softmax over several."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(model_dir).eval()
    tok = AutoTokenizer.from_pretrained(model_dir)
    rows = []
    with torch.no_grad():
        if model.config.num_labels == 1:
            for doc in DOCS:
                rows.append(model(**tok(QUERY, doc, return_tensors="pt")).logits[0])
        for text in TEXTS:
            logits = model(**tok(text, return_tensors="pt")).logits[0]
            one = model.config.num_labels == 1
            rows.append(torch.sigmoid(logits) if one else torch.softmax(logits, -1))
    return [r.tolist() for r in rows]


def test_pair_encoding_matches_transformers(checkpoints: list[str]) -> None:
    from transformers import AutoTokenizer

    ours, theirs = Tokenizer.from_dir(checkpoints[0]), AutoTokenizer.from_pretrained(checkpoints[0])
    long_doc = " ".join(DOCS * 3)
    for doc in [*DOCS, long_doc]:
        ref = theirs(QUERY, doc)
        assert ours.encode_pair(QUERY, doc) == (ref["input_ids"], ref["token_type_ids"])
        cut = theirs(QUERY, doc, truncation=True, max_length=12)
        assert ours.encode_pair(QUERY, doc, 12) == (cut["input_ids"], cut["token_type_ids"])
    assert 1 in ours.encode_pair(QUERY, DOCS[0])[1]  # the second text is type 1


@pytest.mark.timeout(240)
@pytest.mark.parametrize("tp", [1, 2])
def test_cross_encoders_match_transformers(tp: int, tmp_path: Path, checkpoints: list[str]) -> None:
    out = tmp_path / "scores.json"
    run_world(_rank, tp, 1, checkpoints, str(out), timeout=200)
    got = json.loads(out.read_text())
    for model_dir in checkpoints:
        reference = _reference(model_dir)
        ours = got[model_dir]
        assert [len(r) for r in ours] == [len(r) for r in reference]
        assert torch.allclose(torch.tensor(ours), torch.tensor(reference), atol=1e-5), (
            ours,
            reference,
        )
    scores = [row[0] for row in got[checkpoints[0]][: len(DOCS)]]
    assert not all(0 < s < 1 for s in scores)  # raw logits (Identity), not sigmoids
