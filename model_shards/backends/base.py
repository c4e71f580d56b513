"""The backend boundary: every op a model runs, with its contract.

A backend is chosen once per worker (:func:`model_shards.backends.select_backend`)
from the device, the dtype and the environment, and handed to every layer when the
model is built. Layers call these ops and never test the device themselves.

* ``reference`` (:mod:`.reference`): plain PyTorch, the numerical specification;
* ``cpu`` (:mod:`.cpu`): the fused C++ kernels of ``model_shards/backends/cpu/kernels`` and the
  packed GEMM;
* ``cuda`` (:mod:`.cuda`): Triton kernels, the batched on-device sampler.

Shapes: ``T`` tokens of a step, ``nh``/``nkv`` query/key-value heads of this rank,
``D`` head dim, pools ``[slots, nkv, D]`` with slot ``b * block_size + i`` holding
token ``i`` of block ``b``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from model_shards.worker.kv_cache import KVPool

if TYPE_CHECKING:
    from model_shards.backends.cuda.graphs import GraphBackend


@dataclass
class PrefillMeta:
    """The prefill chunks of one step, for one varlen attention call over the paged pool.

    Chunk ``n`` is the packed rows ``q_starts[n] .. q_starts[n] + q_lens[n] - 1``; its
    query ``i`` sits at position ``start_positions[n] + i`` and attends causally to
    positions ``0 .. start_positions[n] + i`` of its sequence, read through
    ``block_tables[n]`` (prefix-cached context included: its own K/V are already in
    the pool when attention runs). Tensors on the step's device, int64; the ``*_list``
    fields are the same numbers as Python ints (for the reference loop). ``window``: a
    sliding window — query ``p`` then sees only positions ``> p - window`` (the table's
    earlier entries may be stale: never read them unmasked).
    """

    q_starts: torch.Tensor  # [N]
    q_lens: torch.Tensor  # [N]
    start_positions: torch.Tensor  # [N]
    block_tables: torch.Tensor  # [N, nblk], padded with 0
    q_starts_list: list[int]
    q_lens_list: list[int]
    start_positions_list: list[int]
    block_size: int
    window: int | None = None

    @property
    def num_chunks(self) -> int:
        return len(self.q_lens_list)

    @property
    def max_q_len(self) -> int:
        return max(self.q_lens_list, default=0)

    @property
    def max_context_len(self) -> int:
        ends = [s + n for s, n in zip(self.start_positions_list, self.q_lens_list, strict=True)]
        return max(ends, default=0)


@dataclass(frozen=True)
class RotaryStep:
    """Where a step's ``T`` new tokens go: their positions ``[T]`` (int64), the model's
    rotary tables ``cos/sin_cached: [P, D]`` (float32) and each token's K/V slot ``[T]``
    (int64; negative: a padding row)."""

    positions: torch.Tensor
    cos_cached: torch.Tensor
    sin_cached: torch.Tensor
    slot_mapping: torch.Tensor


@dataclass(frozen=True)
class DecodeMeta:
    """The single-token rows of a step: ``block_tables [B, nblk]`` (padded with 0) and
    ``context_lens [B]`` (the new token included), int64; ``max_context_len`` an upper
    bound of the lengths known on the host (``None``: the table width × block size);
    ``window``: a sliding window, as in :class:`PrefillMeta`."""

    block_tables: torch.Tensor
    context_lens: torch.Tensor
    max_context_len: int | None = None
    window: int | None = None


@dataclass(frozen=True)
class ExpertWeights:
    """The stacked weights of a rank's ``E`` experts (an MoE layer's, see
    :mod:`model_shards.layers.moe`): ``w13 [E, 2I, H]`` (each expert's gate rows, then its
    up rows), ``w2 [E, H, I]`` (down); ``packed13`` / ``packed2``: per expert, what
    :meth:`Backend.pack_linear` returned for ``w13[e]`` / ``w2[e]`` (empty: not packed)."""

    w13: torch.Tensor
    w2: torch.Tensor
    packed13: tuple[object | None, ...] = ()
    packed2: tuple[object | None, ...] = ()

    @property
    def num_experts(self) -> int:
        return int(self.w13.shape[0])

    def packed(self, e: int) -> tuple[object | None, object | None]:
        """Expert ``e``'s packed gate/up and down weights (``None``: the dense slices)."""
        if not self.packed13:
            return None, None
        return self.packed13[e], self.packed2[e]


class Backend(ABC):
    """The ops of a model's forward pass and of sampling. Subclasses override what they
    accelerate; each method's docstring is the contract every backend meets."""

    name: str = "abstract"
    # whether the sampler keeps the logits on the device and samples them batched there
    # (model_shards.worker.sampling_batch) instead of row by row on the host
    samples_on_device: bool = False

    # ---- norms and activations -------------------------------------------------------
    @abstractmethod
    def rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``x: [T, H]`` → ``(y, s)``, ``s = x + residual`` rounded to the dtype (``s = x``
        without a residual), ``y = w * round(s / rms(s))`` with the statistics in float32.
        A backend may write ``s`` into ``residual`` and return it."""

    @abstractmethod
    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """``x = [gate | up]: [T, 2I]`` → ``silu(gate) * up: [T, I]``."""

    # ---- attention -------------------------------------------------------------------
    @abstractmethod
    def rotary_and_cache(
        self, qkv: torch.Tensor, step: RotaryStep, pool: KVPool, heads: tuple[int, int]
    ) -> torch.Tensor:
        """``qkv: [T, (nh + 2 nkv) * D]`` with ``heads = (nh, nkv)`` → rotated
        ``q: [T, nh, D]``.

        RoPE (half-split layout, ``step.cos/sin_cached: [P, D]`` float32 indexed by
        ``step.positions [T]``) on q and k; k and v are stored in ``pool`` at
        ``step.slot_mapping [T]`` (a negative slot: the row is padding and nothing is
        stored). ``qkv`` may be rotated in place and ``q`` be a view of it."""

    @abstractmethod
    def decode_attention(
        self,
        q: torch.Tensor,
        pool: KVPool,
        meta: DecodeMeta,
        scale: float,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """Single-token queries ``q: [B, nh, D]`` over their whole context → ``[B, nh, D]``.

        Scores ``s = scale * q·k``, squashed to ``softcap * tanh(s / softcap)`` when
        ``softcap`` is given (Gemma 2), softmax in float32.
        Row ``b`` attends to positions ``0 .. meta.context_lens[b] - 1`` (only the last
        ``meta.window`` of them with a window) through
        ``meta.block_tables[b]`` (``[B, nblk]``); query head ``h`` reads KV head
        ``h // (nh / nkv)``. A row with context length 0 (padding) answers zeros.
        ``meta.max_context_len``: a host-side bound of the lengths (kernels size their
        launch grid by it instead of reading the device; CUDA graphs pass the static
        bound)."""

    @abstractmethod
    def prefill_attention(
        self,
        q: torch.Tensor,
        pool: KVPool,
        meta: PrefillMeta,
        scale: float,
        out: torch.Tensor,
        softcap: float | None = None,
    ) -> None:
        """Causal attention of every prefill chunk of a step (:class:`PrefillMeta`, its
        window included): reads ``q: [T, nh, D]`` at the chunks' rows and writes those
        rows of ``out: [T, nh, D]`` (other rows untouched); ``softcap`` as in
        :meth:`decode_attention`."""

    # ---- GEMM ------------------------------------------------------------------------
    def pack_linear(self, weight: torch.Tensor) -> object | None:
        """A faster layout of ``weight [out, in]`` for :meth:`linear`, kept beside the
        parameter, or ``None`` where the dense weight is what this backend reads."""
        return None

    @abstractmethod
    def linear(
        self, x: torch.Tensor, weight: torch.Tensor, packed: object, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """``x [T, in]`` → ``x W^T + b: [T, out]``; ``packed`` is what :meth:`pack_linear`
        returned for ``weight``."""

    # ---- mixture of experts ---------------------------------------------------------
    @abstractmethod
    def fused_moe(
        self,
        x: torch.Tensor,
        experts: ExpertWeights,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
    ) -> torch.Tensor:
        """The routed experts of a step: ``x [T, H]``, ``topk_ids [T, k]`` int64 indices
        into this rank's experts (``-1``: an expert another rank holds, skipped),
        ``topk_weights [T, k]`` float32 → ``[T, H]`` in ``x.dtype``:
        ``out[t] = sum_j w[t, j] * down_e(silu(gate_e x[t]) * up_e x[t])``, ``e = ids[t, j]``,
        summed in float32 in ascending expert order and rounded once; a row routed to no
        local expert answers zeros. Where the backend's GEMM computes each row on its own
        (the cpu backend's packed GEMM), so does this: row ``t`` depends on row ``t`` only."""

    # ---- sampling --------------------------------------------------------------------
    @abstractmethod
    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """``x: [S, V]`` → ``[S]`` int64, torch.argmax's answer (first maximum; a NaN wins)."""

    @abstractmethod
    def exponential_race(self, probs: torch.Tensor, seeds: torch.Tensor) -> torch.Tensor:
        """One draw per row of ``probs [S, V]`` (float32, non-negative) with ``seeds [S]``
        int64 → ``[S]`` int64: the winner of ``argmin_i -log(u_i) / p_i`` with the
        counter-hashed uniforms of :func:`model_shards.backends.reference.race_uniforms`.
        A row with no positive mass answers 0."""

    # ---- step lifecycle ----------------------------------------------------------------
    def graph_backend(self) -> GraphBackend | None:
        """What captures and replays decode steps as graphs; ``None``: steps run eagerly."""
        return None

    def synchronize(self) -> None:  # noqa: B027 (a no-op unless the device queues work)
        """Wait for queued device work (a no-op on CPU)."""
