"""``GET /metrics``: Prometheus text that parses, with counts matching the traffic sent."""

from __future__ import annotations

import pytest

from server.http.metrics import Metrics
from tests.server.conftest import ServeFactory
from tests.server.prometheus import samples

pytestmark = pytest.mark.timeout(60)


async def test_metrics_after_traffic(serve: ServeFactory) -> None:
    served = await serve()
    usage_prompt = usage_completion = 0
    for body in (
        {"prompt": "Hello world", "max_tokens": 3},
        {"prompt": "one two", "max_tokens": 2, "n": 2},
        {"prompt": "one", "max_tokens": 2, "stream": True},
    ):
        response = await served.http.post("/v1/completions", json=body)
        assert response.status_code == 200
        if not body.get("stream"):
            usage = response.json()["usage"]
            usage_prompt += usage["prompt_tokens"] * (2 if body.get("n") else 1)
            usage_completion += usage["completion_tokens"]
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    response = await served.http.post("/v1/chat/completions", json=chat)
    usage_prompt += response.json()["usage"]["prompt_tokens"]
    usage_completion += response.json()["usage"]["completion_tokens"]
    assert (await served.http.post("/v1/completions", json={"prompt": ""})).status_code == 400
    assert (await served.http.get("/nowhere")).status_code == 404

    response = await served.http.get("/metrics")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    got = samples(response.text)

    def http(route: str, status: str) -> float:
        return got[("shardserve_http_requests_total", (("route", route), ("status", status)))]

    assert http("/v1/completions", "200") == 3
    assert http("/v1/completions", "400") == 1
    assert http("/v1/chat/completions", "200") == 1
    assert http("other", "404") == 1
    sequences = 1 + 2 + 1 + 1
    assert got[("shardserve_time_to_first_token_seconds_count", ())] == sequences
    assert got[("shardserve_e2e_request_latency_seconds_count", ())] == sequences
    # the streamed request: 2 prompt tokens ("<s>", "one"), 2 generated
    assert got[("shardserve_prompt_tokens_total", ())] == usage_prompt + 2
    assert got[("shardserve_generation_tokens_total", ())] == usage_completion + 2
    itl_count = got[("shardserve_inter_token_latency_seconds_count", ())]
    assert itl_count == got[("shardserve_generation_tokens_total", ())] - sequences
    finished = {k[1]: v for k, v in got.items() if k[0] == "shardserve_sequences_finished_total"}
    assert sum(finished.values()) == sequences
    assert got[("shardserve_num_requests_running", ())] == 0
    assert got[("shardserve_num_requests_waiting", ())] == 0
    assert got[("shardserve_kv_cache_usage_ratio", ())] == 0  # engine does not report yet
    assert got[("shardserve_prefix_cache_hit_rate", ())] == 0
    assert got[("shardserve_num_preemptions_total", ())] == 0


def test_record_engine_stats() -> None:
    metrics = Metrics()
    metrics.record_engine_stats(kv_cache_usage=0.25, prefix_cache_hit_rate=0.5, preemptions_total=3)
    metrics.record_engine_stats(preemptions_total=5)
    metrics.record_engine_stats(preemptions_total=1)  # engine restarted: re-based, no decrease
    metrics.record_engine_stats(preemptions_total=2)
    got = samples(metrics.render().decode())
    assert got[("shardserve_kv_cache_usage_ratio", ())] == 0.25
    assert got[("shardserve_prefix_cache_hit_rate", ())] == 0.5
    assert got[("shardserve_num_preemptions_total", ())] == 6


def test_two_apps_do_not_share_metrics() -> None:
    first, second = Metrics(), Metrics()
    first.count_http("/health", 200)
    assert ("shardserve_http_requests_total", (("route", "/health"), ("status", "200"))) not in (
        samples(second.render().decode())
    )
