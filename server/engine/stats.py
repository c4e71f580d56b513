"""Engine counters from every replica, summed into the ``/metrics`` engine gauges.

:class:`EngineStatsBoard` keeps each replica's latest :class:`~model_shards.messages.EngineStats`
(sent with every ``StepOutputs``) and sets, over all replicas: KV cache usage (blocks used /
total), the prefix-cache hit rate (hit tokens / (hit + computed prompt tokens)), the preemption
total and the frames the engine ports dropped, speculative decoding's counters
(:meth:`~server.http.metrics.Metrics.record_engine_stats` re-bases both when a replica
restarts from 0) and, for MoE models, per-expert token counts (each replica's latest sample,
summed). :meth:`EngineStatsBoard.forget` drops a replica that went away, with its KV blocks.
"""

from __future__ import annotations

from collections.abc import Callable

from model_shards.messages import EngineStats
from server.http.metrics import Metrics


class EngineStatsBoard:
    """The latest :class:`EngineStats` of each replica, published to ``metrics``."""

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics
        self._latest: dict[int, EngineStats] = {}
        # MoE: each replica's latest per-expert counts (sampled: most stats carry none)
        self._expert_tokens: dict[int, dict[int, list[int]]] = {}

    def reporter(self, replica: int) -> Callable[[EngineStats], None]:
        """The ``on_stats`` callback for replica ``replica``'s engine client."""
        return lambda stats: self.update(replica, stats)

    def update(self, replica: int, stats: EngineStats) -> None:
        self._latest[replica] = stats
        if stats.moe_expert_tokens is not None:
            self._expert_tokens[replica] = stats.moe_expert_tokens
            self._metrics.record_moe_expert_tokens(self._expert_totals())
        self._publish()

    def forget(self, replica: int) -> None:
        self._expert_tokens.pop(replica, None)
        if self._latest.pop(replica, None) is not None:
            self._publish()

    def _expert_totals(self) -> dict[int, list[int]]:
        """Per MoE layer, each expert's tokens summed over the replicas."""
        totals: dict[int, list[int]] = {}
        for by_layer in self._expert_tokens.values():
            for layer, counts in by_layer.items():
                into = totals.setdefault(layer, [0] * len(counts))
                for expert, n in enumerate(counts):
                    into[expert] += n
        return totals

    def _publish(self) -> None:
        all_stats = list(self._latest.values())
        used = sum(s.kv_blocks_used for s in all_stats)
        total = sum(s.kv_blocks_total for s in all_stats)
        hits = sum(s.prefix_cache_hit_tokens for s in all_stats)
        computed = sum(s.prefill_tokens_computed for s in all_stats)
        self._metrics.record_engine_stats(
            kv_cache_usage=used / total if total else 0.0,
            prefix_cache_hit_rate=hits / (hits + computed) if hits + computed else 0.0,
            preemptions_total=sum(s.num_preemptions for s in all_stats),
            mm_encoder_cache=(
                sum(s.mm_encoder_cache_hits for s in all_stats),
                sum(s.mm_encoder_cache_misses for s in all_stats),
            ),
            rejected_messages_total=sum(s.rejected_messages for s in all_stats),
        )
        per_pos = [0] * max((len(s.spec_accepted_per_pos) for s in all_stats), default=0)
        for s in all_stats:
            for pos, n in enumerate(s.spec_accepted_per_pos):
                per_pos[pos] += n
        self._metrics.record_spec_decode(
            sum(s.spec_num_drafts for s in all_stats),
            sum(s.spec_num_draft_tokens for s in all_stats),
            sum(s.spec_num_accepted_tokens for s in all_stats),
            per_pos,
        )
