"""The load tester reports speculative decoding's acceptance beside tok/s when the server's
``/metrics`` exposes the ``spec_decode`` counters (shardserve's or vLLM's names), and nothing
when it does not."""

from __future__ import annotations

import asyncio

import httpx

from deploy.loadtest_lib.client import spec_decode_totals
from deploy.loadtest_lib.config import SLO
from deploy.loadtest_lib.metrics import compute_metrics, with_spec_decode
from deploy.loadtest_lib.records import RequestRecord

EXPOSITION = """# HELP shardserve_spec_decode_num_drafts_total Verify steps of a sequence.
shardserve_spec_decode_num_drafts_total 10.0
shardserve_spec_decode_num_draft_tokens_total 40.0
shardserve_spec_decode_num_accepted_tokens_total 30.0
shardserve_spec_decode_num_accepted_tokens_per_pos_total{position="0"} 9.0
"""


def _totals(text: str, status: int = 200) -> tuple[float, float, float] | None:
    transport = httpx.MockTransport(lambda request: httpx.Response(status, text=text))

    async def read() -> tuple[float, float, float] | None:
        async with httpx.AsyncClient(transport=transport, base_url="http://x") as client:
            return await spec_decode_totals(client)

    return asyncio.run(read())


def test_acceptance_between_two_readings() -> None:
    assert _totals(EXPOSITION) == (10.0, 40.0, 30.0)
    assert _totals(EXPOSITION.replace("shardserve_", "vllm:")) == (10.0, 40.0, 30.0)
    assert _totals("shardserve_num_preemptions_total 3.0\n") is None
    assert _totals(EXPOSITION, status=404) is None
    m = compute_metrics([RequestRecord(0, 3, status="ok", output_tokens=3)], 1.0, SLO())
    got = with_spec_decode(m, (10.0, 40.0, 30.0), (14.0, 56.0, 42.0))
    assert got.spec_acceptance == 12 / 16 and got.spec_tokens_per_step == 1 + 12 / 4
    assert with_spec_decode(m, None, (1.0, 1.0, 1.0)) == m
    assert with_spec_decode(m, (1.0, 4.0, 2.0), (1.0, 4.0, 2.0)) == m  # no proposal
