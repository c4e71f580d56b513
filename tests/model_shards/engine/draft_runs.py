"""Draft-model speculation on a real replica (tiny Llama target at tp=1 and tp=2, the draft at
tp=1 in rank 0's process), run in :mod:`.test_speculative_engine`'s world.

On the target's worker: a coordinator whose draft is the target itself (greedy requests: the
draft proposes what the target picks, so nearly every draft is accepted, which the counters
show), then one with a different random 1-layer draft (few drafts accepted, many rolled back),
greedy and seeded sampled requests. A pool of a few blocks (preemptions) and a repeated prompt
(a prefix-cache hit). :func:`check_draft_runs`: tokens and finish reasons are the plain run's;
every target KV block and every draft block is free afterwards.
"""

from __future__ import annotations

import json
from typing import Any

from model_shards.config.replica import ReplicaConfig
from model_shards.engine.coordinator import Coordinator
from model_shards.engine.speculative.draft_model import DraftModel, build_draft
from model_shards.messages import GenerateRequest, SamplingParams
from model_shards.worker.decoder_worker import Worker
from tests.model_shards.engine.engine_harness import BLOCK, MAX_LEN

K = 3


def requests(greedy_only: bool) -> list[GenerateRequest]:
    motif = [11, 22, 33, 44, 55, 66]
    greedy = SamplingParams(0.0)
    reqs = [
        GenerateRequest("motif", motif * 3, 20, greedy, ignore_eos=True),
        GenerateRequest("plain", [5, 9, 200, 17], 16, greedy),
        GenerateRequest("again", motif * 3, 20, greedy, ignore_eos=True),
        GenerateRequest("long", list(range(40, 70)), 16, greedy, ignore_eos=True),
    ]
    if not greedy_only:
        reqs.append(GenerateRequest("seeded", [3, 4, 3, 4, 3], 16, SamplingParams(0.9, seed=7)))
    return reqs


def _run(coord: Coordinator, requests: list[GenerateRequest]) -> dict[str, object]:
    for req in requests:
        coord.add_request(req)
    out: dict[str, list[object]] = {r.request_id: [[], None] for r in requests}
    while coord.has_work():
        for update in coord.pump():
            o = out[update.output.request_id]
            o[0] += update.output.new_token_ids  # type: ignore[operator]
            o[1] = update.output.finish_reason
    coord.step()  # flush the last frees (to the ranks and to the draft)
    stats = coord.stats
    assert stats.num_free_blocks == stats.num_blocks, "KV blocks leaked"
    spec = stats.spec
    return {
        "out": out,
        "spec": [spec.drafts, spec.draft_tokens, spec.accepted_tokens],
        "preemptions": stats.num_preemptions,
        "hits": stats.prefix_cache_hit_tokens,
    }


def _coordinator(worker: Worker, draft_dir: str | None) -> tuple[Coordinator, DraftModel | None]:
    spec = (
        None if draft_dir is None else json.dumps({"model": draft_dir, "num_speculative_tokens": K})
    )
    replica = ReplicaConfig(
        draft_dir or "", dtype="float32", block_size=BLOCK, max_num_seqs=4, speculative_config=spec
    )
    draft = build_draft(replica, worker, MAX_LEN)
    coord = Coordinator(
        worker,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        max_model_len=MAX_LEN,
        speculative=replica.speculative,
        draft=draft,
    )
    return coord, draft


def draft_runs(worker: Worker, model_dir: str, draft_dir: str) -> dict[str, object]:
    """Rank 0: the plain run of :func:`requests`, then the runs with the target as its own draft
    (greedy requests only) and with ``draft_dir``; then the ranks are told to shut down."""
    results = {}
    for name, draft_dir_or_none, greedy_only in (
        ("plain", None, False),
        ("self", model_dir, True),
        ("random", draft_dir, False),
    ):
        coord, draft = _coordinator(worker, draft_dir_or_none)
        results[name] = _run(coord, requests(greedy_only))
        if draft is not None:
            assert draft.num_free_blocks == draft.worker.kv.num_blocks, "draft blocks leaked"
    coord.shutdown()
    return results


def check_draft_runs(res: dict[str, Any]) -> None:
    """Identity with the plain run under preemption and prefix hits; acceptance ~1 for the
    target as its own draft, low for the random draft."""
    plain = res["plain"]
    for name in ("self", "random"):
        for rid, got in res[name]["out"].items():
            assert got == plain["out"][rid], (name, rid)
        assert res[name]["preemptions"] > 0 and res[name]["hits"] > 0, name
    assert plain["spec"] == [0, 0, 0]
    drafts, draft_tokens, accepted = res["self"]["spec"]
    assert drafts > 0 and accepted >= 0.95 * draft_tokens, res["self"]["spec"]
    drafts, draft_tokens, accepted = res["random"]["spec"]
    assert drafts > 0 and accepted < 0.5 * draft_tokens, res["random"]["spec"]
