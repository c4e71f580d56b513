"""The TTFT breakdown's arithmetic and table, without a server."""

from __future__ import annotations

from benchmarks.suites import ttft

MS = 1_000_000  # ns


def _record() -> tuple[dict[str, int], dict[str, object]]:
    client = {"sent": 0, "first_byte": 40 * MS}
    frontend = {"http_received": 1 * MS, "tokenized": 2 * MS, "batch_sent": 3 * MS}
    frontend |= {"frontend_received": 36 * MS, "first_flush": 38 * MS}
    engine = {"received": 4 * MS, "plan_sent": 5 * MS, "forward_done": 30 * MS}
    engine |= {"sampled": 34 * MS}
    return client, {"request_ids": ["cmpl-1"], "frontend": frontend, "engine": engine}


def test_stages_follow_the_path_and_sum_to_the_ttft() -> None:
    client, record = _record()
    stages = ttft.stage_ms(client, record)
    assert sum(stages.values()) == 40.0  # consecutive stamps: nothing lost, nothing twice
    assert stages["connect + HTTP parse (uvicorn)"] == 1.0
    assert stages["tokenization"] == 1.0  # from http_received: the stages between are absent
    assert stages["frontend batch window"] == 1.0
    assert stages["ZMQ hop to rank 0"] == 1.0
    assert stages["prefill compute (all layers)"] == 25.0
    assert stages["sampling"] == 4.0  # no lm_head_done stamp: the LM head is merged in
    assert "LM head" not in stages
    assert stages["ZMQ hop to the frontend"] == 2.0
    assert stages["first SSE flush"] == 2.0 and stages["socket to the client"] == 2.0


def test_table_has_one_column_per_dtype() -> None:
    client, record = _record()
    summary = ttft.summarize([ttft.stage_ms(client, record)] * 3, [40.0, 41.0, 50.0], [38.0, 39.0])
    assert summary["ttft_ms"] == 38.5 and summary["requests"] == 2  # the untraced ones
    assert summary["traced_ttft_ms"] == 41.0 and summary["traced_requests"] == 3
    rows = [{"dtype": d, "layout": ttft.LAYOUT, "ttft": summary} for d in ("bfloat16", "float32")]
    table = ttft.ttft_table({"rows": rows})
    assert table.splitlines()[0].startswith("| stage") and "| float32 ms | bfloat16 ms |" in table
    assert "| prefill compute (all layers) | 25.00 | 25.00 |" in table
    assert (
        "| TTFT at the client, these traced requests (median) | 41.0 (n=3) | 41.0 (n=3) |" in table
    )
    assert (
        "| **TTFT at the client, tracing off (median)** | **38.5** (n=2) | **38.5** (n=2) |"
        in table
    )
    assert ttft.ttft_table({"rows": []}) == "(not measured)"
