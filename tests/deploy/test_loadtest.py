"""deploy/loadtest.py against a fake OpenAI-compatible server with injected timings."""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import pytest

from deploy.loadtest import main, run_benchmark
from deploy.loadtest_lib.arrivals import arrival_schedule
from deploy.loadtest_lib.config import SLO, LoadPoint, RunConfig, parse_slo
from deploy.loadtest_lib.metrics import compute_metrics, percentile
from deploy.loadtest_lib.plots import CHART_FILES
from deploy.loadtest_lib.records import RequestRecord
from deploy.loadtest_lib.results import load_result, result_to_json, save_result
from tests.deploy.fake_openai import MODEL, FakeOpenAI, fake_token_count, running, seen

SLACK_MS = 10.0
TTFT_HTTP_MS = 5.0
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def config(base_url: str, **overrides: object) -> RunConfig:
    fields: dict[str, object] = {
        "base_url": base_url,
        "model": "",
        "endpoint": "completions",
        "points": (LoadPoint(2, None),),
        "input_len": 16,
        "output_len": 10,
        "num_requests": 8,
    }
    fields.update(overrides)
    return RunConfig(**fields)  # type: ignore[arg-type]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("endpoint", ["completions", "chat"])
async def test_latencies_match_injected_delays(endpoint: str) -> None:
    fake = FakeOpenAI(ttft_s=0.05, itl_s=0.02)
    with running(fake) as url:
        result = await run_benchmark(config(url, endpoint=endpoint))
    (point,) = result.points
    m = point.metrics
    assert result.config.model == MODEL
    assert (m.sent, m.completed, m.errors) == (8, 8, {})
    assert all(r.output_tokens == 10 and r.usage_reported for r in point.requests)
    assert all(len(r.itl_ms) == 9 and r.chunks == 10 for r in point.requests)
    assert m.output_tokens == 80
    assert m.ttft_ms.mean is not None and m.itl_ms.mean is not None
    # Never below the injected delays; TTFT also pays the HTTP round trip and request
    # parsing (3-8 ms on a busy 2-CPU box), hence its extra slack.
    assert m.ttft_ms.mean >= 50.0 - 1.0 and m.itl_ms.mean >= 20.0 - 1.0
    assert m.ttft_ms.mean == pytest.approx(50.0, abs=SLACK_MS + TTFT_HTTP_MS)
    assert m.itl_ms.mean == pytest.approx(20.0, abs=SLACK_MS)
    assert m.tpot_ms.mean == pytest.approx(20.0, abs=SLACK_MS)
    # End to end is the first token plus nine gaps; each gap's few ms of machine noise add up,
    # so check the sum against the measured parts, and the floor against the injected ones.
    assert m.e2e_ms.mean == pytest.approx(m.ttft_ms.mean + 9 * m.itl_ms.mean, abs=2 * SLACK_MS)
    assert m.e2e_ms.mean >= 50.0 + 9 * 20.0 - 1.0
    for r in point.requests:  # TPOT is (e2e - ttft) / (output_tokens - 1), per request
        assert r.tpot_ms == pytest.approx((r.e2e_ms - r.ttft_ms) / 9)  # type: ignore[operator]
    assert m.output_throughput == pytest.approx(80 / m.duration_s)


@pytest.mark.timeout(60)
async def test_request_body_asks_for_exact_streamed_output() -> None:
    fake = FakeOpenAI(ttft_s=0, itl_s=0)
    with running(fake) as url:
        await run_benchmark(config(url, num_requests=1, extra_body={"temperature": 0}))
        await run_benchmark(config(url, num_requests=1, endpoint="chat", ignore_eos=False))
        completion, chat = seen(url)["bodies"]
    assert completion["stream"] is True and completion["stream_options"] == {"include_usage": True}
    assert completion["max_tokens"] == 10 and completion["ignore_eos"] is True
    assert completion["temperature"] == 0 and completion["model"] == MODEL
    assert chat["max_completion_tokens"] == 10 and "ignore_eos" not in chat
    assert chat["messages"][0]["role"] == "user"


@pytest.mark.timeout(60)
async def test_input_lengths_exact_with_server_tokenizer_and_seeded() -> None:
    fake = FakeOpenAI(ttft_s=0, itl_s=0, tokenizer=True)
    with running(fake) as url:
        first = await run_benchmark(config(url, input_len=40, seed=7))
        await run_benchmark(config(url, input_len=40, seed=7))
        bodies = seen(url)["bodies"]
    prompts_first = [b["prompt"] for b in bodies[:8]]
    prompts_again = [b["prompt"] for b in bodies[8:]]
    assert first.prompt_source == "server-tokenizer"
    assert [r.prompt_tokens for r in first.points[0].requests] == [40] * 8
    assert all(fake_token_count(p) == 40 for p in prompts_first)
    assert sorted(prompts_first) == sorted(prompts_again)  # same prompts, any finish order
    assert len(set(prompts_first)) == 8


@pytest.mark.timeout(60)
async def test_input_lengths_fall_back_to_words() -> None:
    fake = FakeOpenAI(ttft_s=0, itl_s=0, tokenizer=False)
    with running(fake) as url:
        result = await run_benchmark(config(url, input_len=25, num_requests=3))
        bodies = seen(url)["bodies"]
    assert result.prompt_source == "words"
    assert all(len(b["prompt"].split()) == 25 for b in bodies)


def test_poisson_schedule_has_requested_mean_rate() -> None:
    times = arrival_schedule(10_000, rate=20.0, burstiness=1.0, seed=3)
    assert 10_000 / times[-1] == pytest.approx(20.0, rel=0.03)
    assert times == arrival_schedule(10_000, rate=20.0, burstiness=1.0, seed=3)
    assert times != arrival_schedule(10_000, rate=20.0, burstiness=1.0, seed=4)


@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_burstiness_sets_the_variance(burstiness: float) -> None:
    times = arrival_schedule(10_000, rate=10.0, burstiness=burstiness, seed=1)
    gaps = [b - a for a, b in zip([0.0, *times], times, strict=False)]
    mean = statistics.fmean(gaps)
    assert mean == pytest.approx(0.1, rel=0.05)
    cv2 = statistics.pvariance(gaps) / mean**2  # gamma: CV^2 = 1 / shape
    assert cv2 == pytest.approx(1.0 / burstiness, rel=0.1)


@pytest.mark.timeout(60)
async def test_rate_point_sends_on_the_seeded_schedule() -> None:
    fake = FakeOpenAI(ttft_s=0, itl_s=0)
    with running(fake) as url:
        cfg = config(url, points=(LoadPoint(None, 20.0),), num_requests=20, output_len=2, seed=5)
        result = await run_benchmark(cfg)
    starts = [r.start_s for r in result.points[0].requests]
    expected = arrival_schedule(20, 20.0, 1.0, seed=5)
    assert max(abs(s - e) for s, e in zip(starts, expected, strict=True)) < 0.05


@pytest.mark.timeout(60)
def test_errors_counted_by_status_never_retried(tmp_path: Path) -> None:
    fake = FakeOpenAI(ttft_s=0, itl_s=0, fail_pattern=(None, 500, 429, None))
    out = tmp_path / "run.json"
    with running(fake) as url:
        args = ["--base-url", url, "--num-requests", "20", "--concurrency", "4"]
        code = main([*args, "--output-len", "3", "--no-progress", "--out", str(out)])
        assert seen(url)["generation_requests"] == 20
    assert code == 0
    m = load_result(out).points[0].metrics
    assert (m.sent, m.completed, m.errors) == (20, 10, {"http_429": 5, "http_500": 5})


@pytest.mark.timeout(60)
def test_unreachable_server_counts_connect_errors(tmp_path: Path) -> None:
    with running(FakeOpenAI()) as url:
        pass  # the port is free again: nothing listens there now
    out = tmp_path / "run.json"
    argv = ["--base-url", url, "--model", "m", "--num-requests", "3", "--no-progress"]
    assert main([*argv, "--out", str(out)]) == 1
    assert load_result(out).points[0].metrics.errors == {"connect": 3}


@pytest.mark.timeout(60)
async def test_json_round_trips(tmp_path: Path) -> None:
    fake = FakeOpenAI(ttft_s=0.01, itl_s=0.005, fail_pattern=(None, None, 503))
    with running(fake) as url:
        points = (LoadPoint(1, None), LoadPoint(2, 50.0, 0.5))
        result = await run_benchmark(config(url, points=points, slo=SLO(ttft_ms=1000.0)))
    path = tmp_path / "r.json"
    save_result(result, path)
    loaded = load_result(path)
    assert loaded == result
    data = json.loads(path.read_text())
    assert (data["schema"], data["version"]) == ("shardserve.loadtest", 1)
    assert result_to_json(loaded) == data
    assert result.points[0].metrics.goodput is not None


@pytest.mark.timeout(60)
def test_plot_and_compare(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fake = FakeOpenAI(ttft_s=0.005, itl_s=0.002)
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    with running(fake) as url:
        base = ["--base-url", url, "--num-requests", "6", "--output-len", "4", "--no-progress"]
        sweep = ["--sweep-concurrency", "1,3"]
        assert main([*base, *sweep, "--out", str(a), "--plot", str(tmp_path / "one")]) == 0
        assert main([*base, *sweep, "--out", str(b), "--slo", "ttft:500,tpot:100"]) == 0
    for directory in ("one", "both"):
        if directory == "both":
            capsys.readouterr()
            assert main(["--compare", str(a), str(b), "--plot", str(tmp_path / "both")]) == 0
            shown = capsys.readouterr().out
            assert "B/A" in shown and "c=3" in shown and "x" in shown
        for name in CHART_FILES:
            png = (tmp_path / directory / name).read_bytes()
            assert png.startswith(PNG_SIGNATURE) and len(png) > 1000


@pytest.mark.timeout(60)
def test_duration_bound_stops_a_slow_server(tmp_path: Path) -> None:
    fake = FakeOpenAI(ttft_s=0.05, itl_s=0.5)
    out = tmp_path / "run.json"
    with running(fake) as url:
        argv = ["--base-url", url, "--concurrency", "3", "--output-len", "100", "--duration", "1"]
        started = time.monotonic()
        assert main([*argv, "--no-progress", "--out", str(out)]) == 1
        elapsed = time.monotonic() - started
    assert elapsed < 5
    m = load_result(out).points[0].metrics
    assert (m.sent, m.completed, m.errors) == (3, 0, {"cancelled": 3})
    assert m.duration_s == pytest.approx(1.0, abs=0.2)


@pytest.mark.timeout(60)
async def test_per_request_timeout() -> None:
    fake = FakeOpenAI(ttft_s=0.05, itl_s=0.5)
    with running(fake) as url:
        result = await run_benchmark(config(url, num_requests=2, output_len=50, timeout_s=0.3))
    assert result.points[0].metrics.errors == {"timeout": 2}


@pytest.mark.timeout(60)
def test_dataset_rows_set_prompt_and_output_len(tmp_path: Path) -> None:
    dataset = tmp_path / "d.jsonl"
    rows = [{"prompt": "hello there", "output_len": 2}, {"prompt": "second"}]
    dataset.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    fake = FakeOpenAI(ttft_s=0, itl_s=0)
    with running(fake) as url:
        argv = ["--base-url", url, "--dataset", str(dataset), "--num-requests", "4"]
        assert main([*argv, "--output-len", "5", "--no-progress"]) == 0
        sent = sorted((b["prompt"], b["max_tokens"]) for b in seen(url)["bodies"])
    assert sent == [("hello there", 2), ("hello there", 2), ("second", 5), ("second", 5)]
    dataset.write_text('{"prompt": 3}\n')
    assert main(["--base-url", "http://127.0.0.1:9", "--dataset", str(dataset)]) == 2


@pytest.mark.parametrize(
    "argv",
    [
        ["--sweep-rate", "1,2", "--request-rate", "3"],
        ["--sweep-rate", "1,2", "--sweep-concurrency", "1"],
        ["--slo", "ttft=5"],
        ["--concurrency", "0"],
        ["--request-rate", "inf", "--duration", "5"],
        ["--extra-body", "[1]"],
    ],
)
def test_bad_flags_exit_2_before_any_request(argv: list[str]) -> None:
    assert main(["--base-url", "http://127.0.0.1:9", *argv]) == 2


def test_metrics_percentiles_goodput_and_error_accounting() -> None:
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([5.0], 99) == 5.0
    fast = RequestRecord(0, 3, status="ok", output_tokens=3, ttft_ms=10.0, e2e_ms=30.0)
    slow = RequestRecord(1, 3, status="ok", output_tokens=3, ttft_ms=300.0, e2e_ms=400.0)
    failed = RequestRecord(2, 3, status="http_500")
    m = compute_metrics([fast, slow, failed], duration_s=2.0, slo=parse_slo("ttft:100,tpot:20"))
    assert (m.sent, m.completed, m.errors) == (3, 2, {"http_500": 1})
    assert m.goodput == 0.5 and m.request_throughput == 1.0
    assert m.tpot_ms.mean == (10.0 + 50.0) / 2
    assert compute_metrics([fast], 1.0, SLO()).goodput is None
