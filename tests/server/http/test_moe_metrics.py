"""MoE routing in ``/metrics``: the per-expert token counts of every replica's engine stats,
summed into ``shardserve_moe_expert_tokens_total{layer,expert}`` and the per-layer
load-imbalance gauge; a replica restarting from zero re-bases the counters."""

from __future__ import annotations

from model_shards.messages import EngineStats, StepOutputs, decode_engine_message, encode
from server.engine.stats import EngineStatsBoard
from server.http.metrics import Metrics
from tests.server.prometheus import samples


def _stats(expert_tokens: dict[int, list[int]] | None) -> EngineStats:
    return EngineStats(0, 0, 0, 8, 0, 0, 0, moe_expert_tokens=expert_tokens)


def _experts(metrics: Metrics) -> dict[tuple[str, str], float]:
    got = samples(metrics.render().decode())
    return {
        (dict(labels)["layer"], dict(labels)["expert"]): value
        for (name, labels), value in got.items()
        if name == "shardserve_moe_expert_tokens_total"
    }


def _imbalance(metrics: Metrics, layer: str) -> float:
    got = samples(metrics.render().decode())
    return got[("shardserve_moe_expert_load_imbalance", (("layer", layer),))]


def test_expert_counts_summed_over_replicas() -> None:
    metrics = Metrics()
    board = EngineStatsBoard(metrics)
    board.update(0, _stats({0: [5, 1, 0, 2], 2: [2, 2, 2, 2]}))
    board.update(1, _stats({0: [1, 1, 4, 0], 2: [0, 0, 0, 8]}))
    board.update(0, _stats(None))  # a step between samples: the latest counts stay
    counts = _experts(metrics)
    assert counts[("0", "0")] == 6 and counts[("0", "2")] == 4 and counts[("2", "3")] == 10
    assert _imbalance(metrics, "0") == 6 * 4 / 14
    assert _imbalance(metrics, "2") == 10 * 4 / 16
    board.update(1, _stats({0: [3, 1, 4, 0], 2: [0, 0, 0, 8]}))
    assert _experts(metrics)[("0", "0")] == 8


def test_a_restarted_replica_re_bases_the_counters() -> None:
    metrics = Metrics()
    board = EngineStatsBoard(metrics)
    board.update(0, _stats({1: [10, 0]}))
    board.forget(0)
    board.update(0, _stats({1: [2, 1]}))  # started again from zero: no decrease
    board.update(0, _stats({1: [7, 1]}))
    counts = _experts(metrics)
    assert counts[("1", "0")] == 15 and counts[("1", "1")] == 1


def test_dense_models_export_no_expert_series() -> None:
    metrics = Metrics()
    EngineStatsBoard(metrics).update(0, _stats(None))
    assert _experts(metrics) == {}


def test_expert_counts_cross_the_wire() -> None:
    sent = StepOutputs([], _stats({0: [3, 0, 1], 5: [2, 2, 0]}))
    got = decode_engine_message(encode(sent))
    assert isinstance(got, StepOutputs) and got.stats is not None
    assert got.stats.moe_expert_tokens == {0: [3, 0, 1], 5: [2, 2, 0]}
