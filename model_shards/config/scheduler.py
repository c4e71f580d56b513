"""The scheduler's configuration (validated once) and its counters."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits of one replica's continuous-batching scheduler.

    ``max_num_seqs``: sequences in one step (also the most that run at once).
    ``max_num_batched_tokens``: tokens in one step, decodes and prefill chunks
    together; must be ``>= max_num_seqs`` so every running decode always fits.
    ``max_model_len``: a sequence stops ("length") when prompt + output reaches it.
    ``block_size`` / ``num_blocks``: the paged KV pool, ``num_blocks`` blocks of
    ``block_size`` token slots each, shared by all sequences.
    ``enable_prefix_caching``: reuse full blocks whose tokens were computed before (every
    KV group's, windowed groups included).
    ``eos_token_ids``: tokens that end a sequence ("stop") unless ``ignore_eos``.
    ``kv_windows``: the attention window of each KV group (:mod:`model_shards.config.kv_layout`),
    group 0 first; ``None`` attends to the whole context. Each group keeps its own block
    table per sequence (block ids from the one pool) and caches its own blocks; a windowed
    group's blocks wholly outside every later query's window are released as the sequence
    advances, and a prefix-cache hit needs from it only the blocks still in the window.
    """

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    block_size: int
    num_blocks: int
    enable_prefix_caching: bool = True
    eos_token_ids: tuple[int, ...] = ()
    kv_windows: tuple[int | None, ...] = (None,)

    @property
    def num_kv_groups(self) -> int:
        return len(self.kv_windows)

    def __post_init__(self) -> None:
        check_step_limits(self.max_num_seqs, self.max_num_batched_tokens, self.block_size)
        if self.max_model_len < 1:
            raise ValueError(f"--max-model-len must be >= 1, got {self.max_model_len}")
        if self.num_blocks < 1:
            raise ValueError("--num-blocks must be >= 1 (give the KV cache more memory)")


def check_step_limits(max_num_seqs: int, max_num_batched_tokens: int, block_size: int) -> None:
    """The scheduler's rules on its flags; ``ValueError`` naming the flag(s) and the fix.

    Each is at least 1, and ``--max-num-batched-tokens >= --max-num-seqs`` so that
    every running sequence can decode each step. One statement of the rules for
    both callers: :class:`SchedulerConfig` and ``ReplicaConfig.validate`` (start-up,
    before any process is spawned).
    """
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
class SchedulerStats:
    """A snapshot of the scheduler's counters (totals since start-up, then gauges).

    ``prefill_tokens_computed``: tokens run as prefill (prompts, and prompt +
    generated tokens when a preempted sequence is recomputed), excluding tokens
    served from the prefix cache and excluding decode tokens.
    ``prefix_cache_hit_tokens``: tokens whose KV was taken from the prefix cache.
    """

    prefill_tokens_computed: int
    prefix_cache_hit_tokens: int
    num_preemptions: int
    num_free_blocks: int
    num_cached_blocks: int
    num_blocks: int
    num_running: int
    num_waiting: int
