"""Continuous batching on a real replica: outputs never depend on what else is running.

One world per layout (tp=2, and pp=2 with overlapped micro-batches) runs, on
rank 0's coordinator:

* a greedy request and a seeded sampled request alone, then among 31 others
  arriving together (greedy and seeded, different lengths): identical outputs;
* 32 requests on a KV pool of a few blocks: preemptions happen, every request
  completes with the unconstrained outputs;
* a shared prompt prefix served from the prefix cache: fewer prefill tokens
  computed, identical output;
* a request resumed from its first 5 tokens (replay after a failure) continues
  with exactly the tokens of the uninterrupted run (seeded, with penalties);
* prompt logprobs (:mod:`tests.model_shards.engine.prompt_scoring`) equal transformers'
  ``log_softmax`` over the same prompts: prompts chunked over several steps, a prompt in the
  prefix cache (scored in full), under preemption, and a 4096-token prompt scored in passes;
* ``--scheduling-policy priority`` with one seat: a request outranking the running one takes
  its seat (preempting it), the rest follow by priority, outputs unchanged;
* with async scheduling (tp2: each step planned before the last one's tokens are back, its
  inputs read on the ranks, broadcast in the tensor group), the same tokens, with and without
  preemption, and with grammar-constrained requests among free ones;
* after each scenario every KV block is free again.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import msgspec
import pytest

from model_shards.engine.coordinator import Coordinator
from model_shards.engine.scheduler import ScheduledStep
from model_shards.messages import GenerateRequest, SamplingParams
from model_shards.parallel.comm import Comm
from model_shards.worker.decoder_worker import Worker
from tests.checkpoints import build_tiny_llama
from tests.model_shards.engine import prompt_scoring
from tests.model_shards.engine.engine_harness import MAX_LEN, build_worker, run_to_completion
from tests.model_shards.engine.test_structured_engine import constrained_requests, free_requests
from tests.world import run_world

SMALL_POOL_BLOCKS = 20
LONG_PROMPT = 4096


def _requests(n: int, seed: int = 0) -> list[GenerateRequest]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = [rng.randrange(3, 1000) for _ in range(rng.randrange(2, 14))]
        sampling = SamplingParams(0.0) if i % 2 else SamplingParams(0.9, top_p=0.9, seed=100 + i)
        out.append(
            GenerateRequest(f"r{i}", prompt, rng.randrange(4, 16), sampling, ignore_eos=True)
        )
    return out


def _coordinator(
    worker: Worker, async_scheduling: bool = False, model_dir: str | None = None
) -> Coordinator:
    return Coordinator(
        worker,
        max_num_seqs=32,
        max_num_batched_tokens=64,
        max_model_len=MAX_LEN,
        async_scheduling=async_scheduling,
        model_dir=model_dir,
    )


def _async_runs(
    worker: Worker, reqs: list[GenerateRequest], model_dir: str | None = None
) -> dict[str, object]:
    """The same requests with async scheduling (at pp == 1): their tokens, the preemptions,
    and how many chunks read a token sampled in the step before (their inputs on the ranks).
    ``model_dir``: grammars compile (constrained requests wait for their tokens)."""
    coord = _coordinator(worker, async_scheduling=True, model_dir=model_dir)
    ahead: list[str] = []  # the request of each chunk that read a token sampled before it
    schedule = coord.scheduler.schedule

    def counting(micro_batches: int = 1) -> ScheduledStep:
        step = schedule(micro_batches)
        chunks = zip(step.chunks, step.sequences, strict=True)
        ahead.extend(seq.request_id for c, seq in chunks if c.token_ids[0] < 0)
        return step

    coord.scheduler.schedule = counting  # type: ignore[method-assign]
    tokens = run_to_completion(coord, reqs)
    stats = coord.stats
    hits, preemptions = stats.prefix_cache_hit_tokens, stats.num_preemptions
    return {"tokens": tokens, "ahead": ahead, "preemptions": preemptions, "hits": hits}


def _batching_rank(peers: Comm, model_dir: str, out_dir: str) -> None:
    ps = peers.ps
    results: dict[str, object] = {}
    for scenario in ("big", "small", "long"):
        if scenario == "long":
            worker = build_worker(peers, model_dir, None, LONG_PROMPT + 8)
            prompt_scoring.shrink_passes(worker.model.config.vocab_size)
        else:
            blocks = None if scenario == "big" else SMALL_POOL_BLOCKS
            worker = build_worker(peers, model_dir, blocks)
        if ps.rank != 0:
            worker.serve_forever()
            continue
        coord = _coordinator(worker)
        if scenario == "long":
            results["long"] = prompt_scoring.long_prompt(worker, LONG_PROMPT, 1024)
        reqs = _requests(32)
        if scenario == "big":
            results["alone"] = {
                r.request_id: run_to_completion(coord, [r])[r.request_id] for r in reqs[:2]
            }
            results["batched"] = run_to_completion(coord, reqs)
            shared = [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18]  # three full blocks
            a = GenerateRequest("a", [*shared, 1, 2], 6, SamplingParams(0.0), ignore_eos=True)
            b = GenerateRequest("b", [*shared, 1, 2], 6, SamplingParams(0.0), ignore_eos=True)
            before = coord.stats.prefill_tokens_computed
            results["prefix_a"] = run_to_completion(coord, [a])["a"]
            mid = coord.stats.prefill_tokens_computed
            results["prefix_b"] = run_to_completion(coord, [b])["b"]
            results["prefill_a"] = mid - before
            results["prefill_b"] = coord.stats.prefill_tokens_computed - mid
            # Replay after a failure: resuming from 5 produced tokens continues identically.
            seeded = msgspec.structs.replace(
                reqs[0],
                sampling=SamplingParams(
                    0.8,
                    top_k=50,
                    seed=7,
                    frequency_penalty=0.5,
                    presence_penalty=0.3,
                ),
                max_tokens=12,
            )
            full = run_to_completion(coord, [seeded])[seeded.request_id]
            resumed = msgspec.structs.replace(seeded, resume_output_ids=full[:5])
            results["resume"] = [full, run_to_completion(coord, [resumed])[seeded.request_id]]
            if ps.pp_size == 1:
                stops = _stopping(reqs[:8], results["batched"])
                results["stops"] = run_to_completion(coord, stops)
                # each coordinator below takes the whole pool: coord's cached blocks are lost
                results["async"] = _async_runs(worker, reqs)
                results["async_prefix"] = _async_runs(worker, [a, b])  # b waits for a, hits it
                results["async_stops"] = _async_runs(worker, stops)
                mixed = free_requests() + constrained_requests()
                results["grammars"] = run_to_completion(
                    _coordinator(worker, False, model_dir), mixed
                )
                results["async_grammars"] = _async_runs(worker, mixed, model_dir)
            results["scored"] = prompt_scoring.chunked_and_cached(worker, MAX_LEN)
            results["priority"] = _by_priority(worker, reqs[2:5])
        elif scenario == "small":
            results["small_pool"] = run_to_completion(coord, reqs)
            results["preemptions"] = preemptions = coord.stats.num_preemptions
            results["small_blocks"] = coord.stats.num_blocks
            if ps.pp_size == 1:
                results["async_small"] = _async_runs(worker, reqs)
            results["preempted_scores"] = prompt_scoring.preempted(coord)
            results["scored_preemptions"] = coord.stats.num_preemptions - preemptions
        coord.shutdown()
    if ps.rank == 0:
        Path(out_dir, "results.json").write_text(json.dumps(results))


def _stopping(reqs: list[GenerateRequest], tokens: dict[str, list[int]]) -> list[GenerateRequest]:
    """``reqs`` stopping at the fourth token each produced (``stop_token_ids``)."""
    return [
        msgspec.structs.replace(r, stop_token_ids=[tokens[r.request_id][3]], ignore_eos=False)
        for r in reqs
    ]


def _by_priority(worker: Worker, reqs: list[GenerateRequest]) -> dict[str, object]:
    """``reqs[0]`` (priority 0) runs alone for two steps; then ``reqs[1]`` (5) and ``reqs[2]``
    (-1) arrive, with one seat: the order the three finish in, and their tokens."""
    coord = Coordinator(
        worker,
        max_num_seqs=1,
        max_num_batched_tokens=64,
        max_model_len=MAX_LEN,
        scheduling_policy="priority",
    )
    first, low, high = (
        msgspec.structs.replace(r, priority=p) for r, p in zip(reqs, (0, 5, -1), strict=True)
    )
    coord.add_request(first)
    out: dict[str, list[int]] = {r.request_id: [] for r in reqs}
    order: list[str] = []
    for pumps in range(10_000):
        if pumps == 2:
            coord.add_request(low)
            coord.add_request(high)
        if pumps > 2 and not coord.has_work():
            break
        for update in coord.pump():
            out[update.output.request_id] += update.output.new_token_ids
            if update.output.finish_reason is not None:
                order.append(update.output.request_id)
    coord.step()  # the last frees
    return {"order": order, "tokens": out, "preemptions": coord.stats.num_preemptions}


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("batching") / "llama", sharded=False)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2)], ids=["tp2", "pp2-overlapped"])
def test_outputs_independent_of_batch(tp: int, pp: int, tmp_path: Path, llama_dir: Path) -> None:
    run_world(_batching_rank, tp, pp, str(llama_dir), str(tmp_path), timeout=240)
    r = json.loads((tmp_path / "results.json").read_text())
    for rid, tokens in r["alone"].items():
        assert r["batched"][rid] == tokens, f"{rid} changed when batched with 31 others"
    assert r["small_blocks"] == SMALL_POOL_BLOCKS
    assert r["preemptions"] > 0, "the small pool should force preemption"
    assert r["small_pool"] == r["batched"], "preemption changed an output"
    full, resumed = r["resume"]
    assert len(full) == 12 and resumed == full[5:], "a resumed request must continue identically"
    by_priority = r["priority"]
    assert by_priority["order"] == ["r4", "r2", "r3"], "priority -1, then 0, then 5"
    assert by_priority["preemptions"] == 1, "r4 (priority -1) takes r2's (0) seat"
    for rid, tokens in by_priority["tokens"].items():
        assert tokens == r["batched"][rid], f"{rid} changed under priority scheduling"
    if pp == 1:  # async scheduling: inputs read on the device, the same tokens
        for run in (r["async"], r["async_small"]):
            assert len(run["ahead"]) > 100, "sequences should follow on while in flight"
            assert run["tokens"] == r["batched"], "async scheduling changed an output"
        assert r["async_small"]["preemptions"] > 0
        assert r["async_prefix"]["hits"] == 12, "b should hit a's three blocks"
        assert r["async_prefix"]["tokens"] == {"a": r["prefix_a"], "b": r["prefix_b"]}
        assert r["async_stops"]["tokens"] == r["stops"], "a stop changed under async scheduling"
        assert all(len(t) <= 4 for t in r["stops"].values())
        assert r["async_grammars"]["tokens"] == r["grammars"], "grammars changed under async"
        assert not {*r["async_grammars"]["ahead"]} - {q.request_id for q in free_requests()}
    assert r["prefix_a"] == r["prefix_b"]
    assert r["prefill_a"] == 14 and r["prefill_b"] == 14 - 12, (r["prefill_a"], r["prefill_b"])
    scored = r["scored"]
    assert scored["hit_prefill"] == 24, "a scored prompt must not take a prefix-cache hit"
    assert r["scored_preemptions"] > 0, "the scored prompts should be preempted"
    prompt_scoring.check_scores(
        llama_dir, {**scored["scores"], **r["preempted_scores"], **r["long"]}
    )
