"""Rank 0's opt-in TTFT stamps: kept per traced request, returned once with its first output.

Unit tests of :class:`RequestTraces`, then a real one-rank replica: a traced and an
untraced request submitted together through the ZMQ handler (``handle`` / ``work``);
only the traced one's first output carries stamps, every stage of the path in order.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from benchmarks.suites.ttft import LAYER_KINDS
from model_shards.config.model import ModelConfig
from model_shards.config.replica import ReplicaConfig
from model_shards.engine.coordinator import Coordinator
from model_shards.engine.request_trace import RequestTraces
from model_shards.engine.scheduler.scheduler import Sequence, SeqUpdate
from model_shards.messages import GenerateRequest, RequestOutput, StepOutputs, SubmitBatch
from model_shards.parallel.comm import Comm
from model_shards.worker.decoder_worker import Worker
from model_shards.worker.layer_timer import PREFIX
from model_shards.worker.step_trace import OFF
from tests.checkpoints import build_tiny_llama
from tests.world import run_world

ENGINE_STAGES = [
    "received",
    "admitted",
    "scheduled",
    "plan_sent",
    "forward_done",
    "lm_head_done",
    "sampled",
    "outputs_built",
]


def _seq(rid: str, trace: bool) -> Sequence:
    req = GenerateRequest(rid, [1, 2], 4, trace=trace)
    return Sequence(0, req, req.sampling, b"")


def _update(seq: Sequence, tokens: list[int]) -> SeqUpdate:
    return SeqUpdate(seq, RequestOutput(seq.request.request_id, tokens))


def test_only_opened_requests_are_stamped_once() -> None:
    traces = RequestTraces()
    traced, plain = _seq("t", True), _seq("p", False)
    assert traces.step([traced, plain]) is OFF  # nothing open: no stamps, no hooks
    traces.open(plain.request, received_ns=1)  # not asked for: never kept
    traces.open(traced.request, received_ns=1)
    assert traces.step([plain]) is OFF  # a step without the traced request
    before = time.monotonic_ns()
    step = traces.step([traced, plain])
    step.stamp("sampled")
    between = time.monotonic_ns()
    traces.step([traced]).stamp("sampled")  # a later step: the first stamps are kept
    first = traces.attach([_update(plain, [3]), _update(traced, [4])])
    assert first[0].output.trace is None
    stamps = first[1].output.trace
    assert stamps is not None and first[1].output.new_token_ids == [4]
    assert list(stamps) == ["received", "admitted", "scheduled", "sampled", "outputs_built"]
    assert stamps["received"] == 1
    assert before <= stamps["scheduled"] <= stamps["sampled"] <= between
    assert between <= stamps["outputs_built"]
    assert traces.step([traced]) is OFF  # answered: no longer traced
    assert traces.attach([_update(traced, [5])])[0].output.trace is None


def test_dropped_request_is_forgotten() -> None:
    traces = RequestTraces()
    traces.open(_seq("t", True).request, received_ns=1)
    traces.drop("t")
    assert traces.step([_seq("t", True)]) is OFF
    assert traces.attach([_update(_seq("t", True), [1])])[0].output.trace is None


def _trace_rank(peers: Comm, model_dir: str, out_dir: str) -> None:
    cfg = ModelConfig.from_dir(model_dir)
    replica = ReplicaConfig(model_dir, dtype="float32", block_size=4, max_num_seqs=4)
    worker = Worker.build(replica, cfg, peers, 64)
    coord = Coordinator(worker, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64)
    traced = GenerateRequest("t", [5, 6, 7, 8, 9], 3, ignore_eos=True, trace=True)
    plain = GenerateRequest("p", [5, 6, 7, 8, 10], 3, ignore_eos=True)
    assert coord.handle(SubmitBatch([traced, plain]), b"frontend") == []
    outputs: list[dict[str, object]] = []
    while coord.has_work():
        for _, message in coord.work():
            assert isinstance(message, StepOutputs)
            outputs += [{"rid": o.request_id, "trace": o.trace} for o in message.outputs]
    coord.shutdown()
    Path(out_dir, "outputs.json").write_text(json.dumps(outputs))


@pytest.mark.timeout(180)
def test_replica_returns_stamps_with_the_first_token(tmp_path: Path) -> None:
    model_dir = build_tiny_llama(tmp_path / "llama", sharded=False)
    run_world(_trace_rank, 1, 1, str(model_dir), str(tmp_path), timeout=150)
    outputs = json.loads((tmp_path / "outputs.json").read_text())
    traced = [o["trace"] for o in outputs if o["rid"] == "t"]
    assert len(traced) == 3 and traced[1:] == [None, None]  # three tokens, stamps once
    assert all(o["trace"] is None for o in outputs if o["rid"] == "p")
    stamps = {k: v for k, v in traced[0].items() if not k.startswith(PREFIX)}
    assert list(stamps) == ENGINE_STAGES  # every stage, inserted in path order
    times = [stamps[s] for s in ENGINE_STAGES]
    assert times == sorted(times)  # monotonic clock: the path's order
    kinds = {k[len(PREFIX) :]: v for k, v in traced[0].items() if k.startswith(PREFIX)}
    assert set(kinds) == set(LAYER_KINDS) and all(v > 0 for v in kinds.values())
    forward_ns = stamps["forward_done"] - stamps["plan_sent"]  # the step's forward (and more)
    blocks = ("embedding", "norms", "attention block", "MLP block")
    assert sum(kinds[k] for k in blocks) <= forward_ns
    assert kinds["attention GEMM"] + kinds["attention kernel"] <= kinds["attention block"]
    assert kinds["MLP GEMM"] <= kinds["MLP block"]
