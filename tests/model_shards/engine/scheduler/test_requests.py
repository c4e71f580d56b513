"""Admission, aborts, finish reasons, seeds and configuration."""

from __future__ import annotations

import pytest

from model_shards.engine.scheduler import Scheduler, SchedulerConfig, SeqStatus
from model_shards.messages import GenerateRequest, SamplingParams
from tests.model_shards.engine.scheduler.sim import (
    EOS,
    FakeWorker,
    assert_quiescent,
    config,
    drive,
    make_request,
    reference,
)

# ---- add ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("prompt", "max_tokens", "match"),
    [
        ([], 4, "prompt is empty"),
        ([1, 2], 0, "max_tokens must be >= 1"),
        ([1] * 64, 4, "context window is 64"),
        ([1] * 33, 1, "more than the whole cache"),  # the prompt alone outgrows 8 blocks of 4
        ([1] * 20, 20, "more than the whole cache"),  # prompt + output would
    ],
)
def test_add_refuses_requests_that_can_never_run(
    prompt: list[int], max_tokens: int, match: str
) -> None:
    sched = Scheduler(config(num_blocks=8, max_model_len=64))
    with pytest.raises(ValueError, match=match):
        sched.add(make_request("x", prompt, max_tokens))
    assert not sched.has_work()


def test_add_accepts_a_request_that_exactly_fills_the_pool() -> None:
    sched = Scheduler(config(num_blocks=8, max_model_len=64))
    req = make_request("x", [3] * 30, max_tokens=3, ignore_eos=True)  # 32 KV slots at most
    run = drive(sched, [req])
    assert run.outputs["x"] == reference(req)[0]


def test_duplicate_live_request_id_is_refused_but_may_be_reused_later() -> None:
    sched = Scheduler(config())
    sched.add(make_request("x", [1, 2]))
    with pytest.raises(ValueError, match="already running"):
        sched.add(make_request("x", [3]))
    sched.abort("x")
    sched.add(make_request("x", [3]))


def test_missing_seed_is_assigned_once_and_sent() -> None:
    sched = Scheduler(config())
    seq = sched.add(make_request("a", [1, 2], seed=None))
    sched.add(make_request("b", [1, 2], seed=1234))
    assert seq.sampling.seed is not None and seq.request.sampling.seed is None
    step = sched.schedule()
    seeds = {n.seq_id: n.sampling.seed for n in step.new_sequences}
    assert seeds == {0: seq.sampling.seed, 1: 1234}
    assert [n.num_prompt_tokens for n in step.new_sequences] == [2, 2]


# ---- abort --------------------------------------------------------------------


def test_abort_waiting_running_and_mid_prefill_release_everything() -> None:
    cfg = config(max_num_batched_tokens=8, max_num_seqs=2)
    sched, worker = Scheduler(cfg), FakeWorker(cfg.num_blocks, cfg.block_size)
    sched.add(make_request("dec", [1, 2, 3], max_tokens=50, ignore_eos=True))
    sched.add(make_request("pre", list(range(1, 41)), max_tokens=5))
    sched.add(make_request("wait", [4, 5]))
    for _ in range(3):
        step = sched.schedule()
        sched.update(step, worker.execute(step))
    seqs = {s.request_id: s for s in sched.running}
    assert seqs["dec"].num_computed > 3 and seqs["pre"].is_prefilling
    assert [s.request_id for s in sched.waiting] == ["wait"]

    assert sched.abort("wait") is not None
    assert not sched.has_pending_frees()  # never reached the ranks
    assert sched.abort("pre") is seqs["pre"] and seqs["pre"].status is SeqStatus.FINISHED
    assert sched.abort("nope") is None
    step = sched.schedule()  # dec decodes; the abort below lands while the step runs
    assert step.freed_seq_ids == [seqs["pre"].seq_id]
    sched.abort("dec")
    assert sched.update(step, worker.execute(step)) == []  # tokens of aborted sequences dropped
    step = sched.schedule()
    assert step.freed_seq_ids == [seqs["dec"].seq_id] and not step.chunks
    sched.update(step, worker.execute(step))
    assert_quiescent(sched, worker)


# ---- finishing ----------------------------------------------------------------


def _finish_of(req: GenerateRequest, **cfg: object) -> tuple[list[int], str]:
    sched = Scheduler(config(**cfg))
    run = drive(sched, [req])
    return run.outputs[req.request_id], run.finish[req.request_id]


def test_finish_reasons() -> None:
    many_eos = tuple(range(48))  # most tokens are eos: stops come quickly
    req = make_request("a", [50, 51], max_tokens=30)
    out, reason = _finish_of(req, eos_token_ids=many_eos)
    assert reason == "stop" and out[-1] in many_eos and (out, reason) == reference(req, many_eos)

    req = make_request("b", [50, 51], max_tokens=30, ignore_eos=True)
    out, reason = _finish_of(req, eos_token_ids=many_eos)
    assert (len(out), reason) == (30, "length")

    req = make_request("c", [50, 51], max_tokens=30, ignore_eos=True, stop_token_ids=[5, 50, 60])
    out, reason = _finish_of(req, eos_token_ids=many_eos)
    assert reason == "stop" and out[-1] in (5, 50, 60) and (out, reason) == reference(req)

    req = make_request("d", [50, 51, 52], max_tokens=30, ignore_eos=True)
    out, reason = _finish_of(req, max_model_len=10)
    assert (len(out), reason) == (7, "length")  # prompt + output reached max_model_len


def test_min_tokens_defers_stops() -> None:
    many_eos = tuple(range(60))
    req = GenerateRequest("m", [50, 51], 20, SamplingParams(seed=3, min_tokens=6))
    out, reason = _finish_of(req, eos_token_ids=many_eos)
    assert len(out) >= 6 and (out, reason) == reference(req, many_eos)
    assert any(t in many_eos for t in out[:5])  # a stop token came early and was ignored


# ---- config -------------------------------------------------------------------


def test_config_validation_names_the_flag() -> None:
    with pytest.raises(ValueError, match=r"--max-num-batched-tokens 4 .*--max-num-seqs 8"):
        SchedulerConfig(8, 4, 64, 4, 16)
    with pytest.raises(ValueError, match="--block-size"):
        SchedulerConfig(8, 8, 64, 0, 16)
    with pytest.raises(ValueError, match="--num-blocks"):
        SchedulerConfig(8, 8, 64, 4, 0)
    assert SchedulerConfig(8, 8, 64, 4, 16).eos_token_ids == ()
    assert EOS in config().eos_token_ids
