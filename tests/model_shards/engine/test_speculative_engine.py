"""Speculative decoding on a real replica (tiny Llama, tp=1 and tp=2): verify steps through the
paged KV cache give exactly the tokens of decoding one token a step.

On one worker, a coordinator without speculation, then one with it, run the same requests:
greedy and seeded sampled ones (top-p, penalties, ``min_tokens``), all with logprobs. A random
tiny model seldom repeats itself, so the speculative run's proposer is an oracle that knows the
plain run's output and gets every third draft wrong: drafts are accepted (their K/V written
through the paged cache and read by later steps) and rejected (rolled back). Tokens, finish
reasons and logprobs agree, under preemption (a pool of a few blocks) and with a prompt served
from the prefix cache. Every KV block is free afterwards. The same world then runs draft-model
speculation (:mod:`.draft_runs`).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from model_shards.config.speculative import SpeculativeConfig
from model_shards.engine.coordinator import Coordinator
from model_shards.messages import GenerateRequest, SamplingParams
from model_shards.parallel.comm import Comm
from model_shards.worker.decoder_worker import Worker
from tests.checkpoints import build_tiny_llama
from tests.model_shards.engine.draft_runs import check_draft_runs, draft_runs
from tests.model_shards.engine.engine_harness import MAX_LEN, build_worker
from tests.world import run_world

SMALL_POOL_BLOCKS = 20  # of 4 tokens: the five requests preempt one another
NGRAM = SpeculativeConfig("ngram", 4, 3, 1, disable_by_batch_size=32)


def _requests() -> list[GenerateRequest]:
    motif = [11, 22, 33, 44, 55, 66]
    sampled = SamplingParams(
        0.8, top_p=0.9, seed=5, frequency_penalty=0.3, min_tokens=3, logprobs=2
    )
    return [
        GenerateRequest("greedy", motif * 3, 24, SamplingParams(0.0, logprobs=1), ignore_eos=True),
        GenerateRequest("sampled", [7, *motif, 8, *motif], 20, sampled),
        GenerateRequest("plain", [5, 9, 200, 17], 16, SamplingParams(0.0, logprobs=1)),
        GenerateRequest("seeded", [3, 4, 3, 4, 3], 16, SamplingParams(1.0, seed=9, logprobs=0)),
    ]


class Oracle:
    """Proposes the plain run's next tokens, every third one wrong (a test's proposer)."""

    def __init__(self, expected: list[int]) -> None:
        self.expected = expected

    def propose(self, tokens: list[int], room: int) -> list[int]:
        ahead = self.expected[len(tokens) : len(tokens) + min(room, 4)]
        return [t if (len(tokens) + i) % 3 else (t + 1) % 1000 for i, t in enumerate(ahead)]

    def record(self, accepted: int) -> None:
        pass


def _run(
    coord: Coordinator, requests: list[GenerateRequest], expected: dict[str, object] | None = None
) -> dict[str, object]:
    for req in requests:
        coord.add_request(req)
    for seq in coord.scheduler.waiting if expected is not None else []:
        ids = expected[seq.request_id]["ids"]  # type: ignore[index]
        seq.proposer = Oracle([*seq.request.prompt_token_ids, *ids])  # type: ignore[assignment]
    out: dict[str, dict[str, object]] = {
        r.request_id: {"ids": [], "finish": None, "lp": []} for r in requests
    }
    while coord.has_work():
        for update in coord.pump():
            o = out[update.output.request_id]
            o["ids"] += update.output.new_token_ids  # type: ignore[operator]
            o["finish"] = update.output.finish_reason
            o["lp"] += [x.logprob for x in update.output.logprobs or []]  # type: ignore[operator]
    coord.step()  # flush the last frees
    stats = coord.stats
    assert stats.num_free_blocks == stats.num_blocks, "KV blocks leaked"
    spec = stats.spec
    return {"out": out, "spec": [spec.drafts, spec.draft_tokens, spec.accepted_tokens]}


def _pair(worker: Worker, requests: list[GenerateRequest]) -> list[dict[str, object]]:
    """The same requests without, then with speculation (the ranks keep serving)."""
    results = []
    for spec in (None, NGRAM):
        coord = Coordinator(
            worker,
            max_num_seqs=8,
            max_num_batched_tokens=64,
            max_model_len=MAX_LEN,
            speculative=spec,
        )
        results.append(_run(coord, requests, results[0]["out"] if results else None))
        if spec is not None:
            results[-1]["preemptions"] = coord.stats.num_preemptions
            results[-1]["hits"] = coord.stats.prefix_cache_hit_tokens
    return results


def _spec_rank(peers: Comm, model_dir: str, draft_dir: str, out_dir: str) -> None:
    worker = build_worker(peers, model_dir, SMALL_POOL_BLOCKS)
    if peers.ps.rank != 0:
        worker.serve_forever()
        return
    reqs = _requests()
    reqs.append(GenerateRequest("again", reqs[0].prompt_token_ids, 24, reqs[0].sampling))
    results = _pair(worker, reqs)
    drafts = draft_runs(worker, model_dir, draft_dir)
    Path(out_dir, "results.json").write_text(json.dumps([*results, drafts]))


@pytest.mark.timeout(240)
@pytest.mark.parametrize("tp", [1, 2])
def test_verify_steps_give_the_tokens_of_plain_decoding(tmp_path: Path, tp: int) -> None:
    model_dir = build_tiny_llama(tmp_path / "llama", sharded=False)
    draft_dir = build_tiny_llama(tmp_path / "draft", sharded=False, num_layers=1, seed=99)
    run_world(_spec_rank, tp, 1, str(model_dir), str(draft_dir), str(tmp_path), timeout=200)
    plain, fast, drafts = json.loads((tmp_path / "results.json").read_text())
    check_draft_runs(drafts)
    for rid, want in plain["out"].items():
        got = fast["out"][rid]
        assert (got["ids"], got["finish"]) == (want["ids"], want["finish"]), rid
        # a step of more rows may round its float32 GEMMs' last bits differently
        assert got["lp"] == pytest.approx(want["lp"], abs=1e-3), rid
    drafts, draft_tokens, accepted = fast["spec"]
    assert drafts > 0 and 0 < accepted < draft_tokens, fast["spec"]
    assert plain["spec"] == [0, 0, 0]
    assert fast["preemptions"] > 0 and fast["hits"] > 0
