"""n-gram speculation on the packaged SmolLM2-135M-Instruct GGUF (quantized CPU kernels): an
editing prompt, whose answer quotes it, decodes to the same greedy tokens with and without
speculation, a good share of the drafts accepted; so does the model as its own draft, nearly
every draft accepted. (The verify rows attend as decodes: through the prefill kernel instead,
this model's greedy output drifted from plain decoding's.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.suites.spec_decode import prompts
from model_shards.config.model import load_model_config
from model_shards.config.replica import ReplicaConfig
from model_shards.config.speculative import SpeculativeConfig
from model_shards.engine.coordinator import Coordinator
from model_shards.engine.speculative.draft_model import build_draft
from model_shards.gguf.tokenizer import tokenizer_from_gguf
from model_shards.launch import packaged_model
from model_shards.messages import GenerateRequest, SamplingParams
from model_shards.parallel.comm import Comm
from model_shards.worker.decoder_worker import Worker
from tests.world import run_world

PROMPT = prompts("editing", 1, "x")[0]  # the bench's editing workload: a block to hand back
NEW_TOKENS = 96
K3 = {"num_speculative_tokens": 3}


def _rank(peers: Comm, model_dir: str, out: str) -> None:
    worker = Worker.build(ReplicaConfig(model_dir), load_model_config(model_dir), peers, 512)
    tokenizer, _ = tokenizer_from_gguf(model_dir)
    prompt = tokenizer.encode(PROMPT, add_special_tokens=False).ids
    results = {}
    as_draft = ReplicaConfig(model_dir, speculative_config=json.dumps({"model": model_dir, **K3}))
    for name, spec in (
        ("plain", None),
        ("ngram", SpeculativeConfig("ngram", 5, 3, 2)),
        ("self", as_draft.speculative),
    ):
        draft = build_draft(as_draft, worker, 512) if name == "self" else None
        coord = Coordinator(
            worker,
            max_num_seqs=4,
            max_num_batched_tokens=256,
            max_model_len=512,
            speculative=spec,
            draft=draft,
        )
        coord.add_request(
            GenerateRequest("r", prompt, NEW_TOKENS, SamplingParams(0.0), ignore_eos=True)
        )
        tokens: list[int] = []
        while coord.has_work():
            tokens += [t for u in coord.pump() for t in u.output.new_token_ids]
        coord.step()  # the ranks drop the sequence: the next coordinator reuses its id
        s = coord.stats.spec
        results[name] = {"tokens": tokens, "spec": [s.drafts, s.draft_tokens, s.accepted_tokens]}
    coord.shutdown()
    Path(out).write_text(json.dumps(results))


@pytest.mark.timeout(240)
def test_editing_prompt_same_tokens_drafts_accepted(tmp_path: Path) -> None:
    model = str(packaged_model.packaged_gguf())
    run_world(_rank, 1, 1, model, str(tmp_path / "out.json"), timeout=200)
    results = json.loads((tmp_path / "out.json").read_text())
    assert results["ngram"]["tokens"] == results["plain"]["tokens"]
    drafts, draft_tokens, accepted = results["ngram"]["spec"]
    assert drafts > 0 and accepted >= draft_tokens / 3, results["ngram"]["spec"]
    assert results["self"]["tokens"] == results["plain"]["tokens"]
    drafts, draft_tokens, accepted = results["self"]["spec"]
    assert drafts > 0 and accepted >= 0.9 * draft_tokens, results["self"]["spec"]
