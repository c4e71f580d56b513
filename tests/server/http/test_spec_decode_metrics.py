"""Speculative decoding in ``/metrics``: every replica's counters summed into vLLM's
``spec_decode`` names (``shardserve_`` prefix), per-position acceptance labelled; the stats
survive the wire."""

from __future__ import annotations

from model_shards.messages import EngineStats, StepOutputs, decode_engine_message, encode
from server.engine.stats import EngineStatsBoard
from server.http.metrics import Metrics
from tests.server.prometheus import samples


def _stats(drafts: int, tokens: int, accepted: int, per_pos: list[int]) -> EngineStats:
    return EngineStats(0, 0, 0, 8, 0, 0, 0, 0, 0, None, 0, drafts, tokens, accepted, per_pos)


def test_spec_counters_summed_over_replicas() -> None:
    metrics = Metrics()
    board = EngineStatsBoard(metrics)
    board.update(0, _stats(4, 12, 7, [4, 2, 1]))
    board.update(1, _stats(1, 3, 3, [1, 1, 1]))
    board.update(0, _stats(5, 15, 8, [5, 2, 1]))
    got = samples(metrics.render().decode())
    assert got[("shardserve_spec_decode_num_drafts_total", ())] == 6
    assert got[("shardserve_spec_decode_num_draft_tokens_total", ())] == 18
    assert got[("shardserve_spec_decode_num_accepted_tokens_total", ())] == 11
    per_pos = "shardserve_spec_decode_num_accepted_tokens_per_pos_total"
    assert [got[(per_pos, (("position", str(p)),))] for p in range(3)] == [6, 3, 2]
    wire = decode_engine_message(encode(StepOutputs([], _stats(1, 2, 3, [3]))))
    assert isinstance(wire, StepOutputs) and wire.stats == _stats(1, 2, 3, [3])
