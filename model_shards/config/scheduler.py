"""The scheduler's configuration (validated once) and its counters."""

from __future__ import annotations

from dataclasses import dataclass

from model_shards.config.speculative import SpeculativeConfig


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits of one replica's continuous-batching scheduler.

    ``kv_windows``: each KV group's window (:mod:`model_shards.config.kv_layout`), group 0
    first, ``None`` the whole context. Each group keeps its own block table per sequence (ids
    from the one pool); a windowed group releases blocks that left every later query's window,
    and a prefix-cache hit needs from it only the blocks still in the window.
    """

    max_num_seqs: int  # per step, and the most that run at once
    max_num_batched_tokens: int  # per step, decodes and prefill chunks; >= max_num_seqs
    max_model_len: int  # a sequence stops ("length") once prompt + output reaches it
    block_size: int  # token slots per block of the paged KV pool
    num_blocks: int  # blocks in the pool, shared by all sequences
    enable_prefix_caching: bool = True  # reuse full blocks computed before, in every KV group
    eos_token_ids: tuple[int, ...] = ()  # end a sequence ("stop") unless ``ignore_eos``
    kv_windows: tuple[int | None, ...] = (None,)
    scheduling_policy: str = "fcfs"  # or "priority": requests' ``priority``, lower first
    max_loras: int = 0  # the ranks' LoRA adapter slots (--max-loras); 0: no adapters
    speculative: SpeculativeConfig | None = None  # n-gram proposals (--speculative-config)
    async_scheduling: bool = False  # the next step planned ahead of the one in flight

    @property
    def num_kv_groups(self) -> int:
        return len(self.kv_windows)

    def __post_init__(self) -> None:
        check_step_limits(self.max_num_seqs, self.max_num_batched_tokens, self.block_size)
        if self.max_model_len < 1:
            raise ValueError(f"--max-model-len must be >= 1, got {self.max_model_len}")
        if self.num_blocks < 1:
            raise ValueError("--num-blocks must be >= 1 (give the KV cache more memory)")
        if self.async_scheduling and self.speculative is not None:
            raise ValueError("--async-scheduling cannot be combined with --speculative-config")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"--scheduling-policy must be one of {', '.join(SCHEDULING_POLICIES)}, "
                f"not {self.scheduling_policy!r}"
            )


SCHEDULING_POLICIES = ("fcfs", "priority")


def check_step_limits(max_num_seqs: int, max_num_batched_tokens: int, block_size: int) -> None:
    """``ValueError`` naming the flag and the fix unless each is >= 1 and
    ``--max-num-batched-tokens >= --max-num-seqs`` (every running sequence decodes each step).
    Shared by :class:`SchedulerConfig` and ``ReplicaConfig.validate`` (before any spawn)."""
    for flag, value in (
        ("--max-num-seqs", max_num_seqs),
        ("--max-num-batched-tokens", max_num_batched_tokens),
        ("--block-size", block_size),
    ):
        if value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    if max_num_batched_tokens < max_num_seqs:
        raise ValueError(
            f"--max-num-batched-tokens {max_num_batched_tokens} is smaller than "
            f"--max-num-seqs {max_num_seqs}; raise it to at least "
            f"{max_num_seqs} so every running sequence can decode each step"
        )


@dataclass(frozen=True)
class SpecCounts:
    """Speculative decoding since start-up: verify steps of a sequence (``drafts``), tokens
    proposed, proposals accepted, and accepted ones by draft position (index 0: the first)."""

    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_pos: tuple[int, ...] = ()


@dataclass(frozen=True)
class SchedulerStats:
    """A snapshot of the scheduler's counters: totals since start-up, then gauges."""

    prefill_tokens_computed: int  # run as prefill, preempted recomputes included; no cache hits
    prefix_cache_hit_tokens: int  # whose KV came from the prefix cache
    num_preemptions: int
    num_free_blocks: int
    num_cached_blocks: int
    num_blocks: int
    num_running: int
    num_waiting: int
    spec: SpecCounts = SpecCounts()  # speculative decoding's counters since start-up
