"""The backend boundary: every op a model runs, with its contract.

:func:`model_shards.backends.select_backend` picks one per worker and hands it to every layer;
layers never test the device. ``reference`` (:mod:`.reference`) is the numerical specification,
``cpu`` (:mod:`.cpu`) runs fused C++ kernels and ``cuda`` (:mod:`.cuda`) Triton kernels.

Shapes: ``T`` tokens of a step, ``nh``/``nkv`` query/key-value heads of this rank, ``D`` head
dim; pools are ``[slots, nkv, D]``, slot ``b * block_size + i`` holding token ``i`` of block ``b``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from model_shards.quant.checkpoint_weight import CheckpointWeight
from model_shards.quant.formats import GGMLType
from model_shards.quant.fp8 import Fp8Weight
from model_shards.quant.int4 import Int4GroupWeight
from model_shards.quant.weights import QuantizedWeight
from model_shards.worker.kv_cache import KVPool

if TYPE_CHECKING:
    from model_shards.backends.cuda.graphs import GraphBackend
    from model_shards.backends.decode_stack import DecodeLayerParts, DecodeStack


@dataclass
class PrefillMeta:
    """The prefill chunks of one step, for one varlen attention call over the paged pool.

    Chunk ``n`` is packed rows ``q_starts[n] .. q_starts[n] + q_lens[n] - 1``; its query ``i``
    sits at position ``start_positions[n] + i`` and attends causally to positions up to it,
    cached prefix included, through ``block_tables[n]`` (its own K/V are already in the pool).
    Tensors are int64 on the step's device; ``*_list``: the same as Python ints. ``window``:
    query ``p`` sees only positions ``> p - window`` (older table entries may be stale).
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
    """Where a step's ``T`` new tokens go."""

    positions: torch.Tensor  # [T] int64
    cos_cached: torch.Tensor  # [P, D] float32, the model's rotary table
    sin_cached: torch.Tensor  # [P, D] float32
    slot_mapping: torch.Tensor  # [T] int64 K/V slots; negative: a padding row


@dataclass(frozen=True)
class HeadNorms:
    """Per-head RMSNorms of q and k before RoPE (Qwen3, Gemma 3): weights ``[D]`` shared by
    all heads of q (``q``) and of k (``k``), in the model's dtype."""

    q: torch.Tensor  # [D]
    k: torch.Tensor  # [D]
    eps: float


@dataclass(frozen=True)
class DecodeMeta:
    """The single-token rows of a step; ``window`` as in :class:`PrefillMeta`."""

    block_tables: torch.Tensor  # [B, nblk] int64, padded with 0
    context_lens: torch.Tensor  # [B] int64, the new token included
    max_context_len: int | None = None  # host-side bound; None: table width × block size
    window: int | None = None


@dataclass(frozen=True)
class ExpertWeights:
    """The stacked weights of this rank's ``E`` experts (:mod:`model_shards.layers.moe`)."""

    w13: torch.Tensor  # [E, 2I, H]: each expert's gate rows, then its up rows
    w2: torch.Tensor  # [E, H, I]: down
    packed13: tuple[object | None, ...] = ()  # per expert, pack_linear(w13[e]); (): not packed
    packed2: tuple[object | None, ...] = ()  # per expert, pack_linear(w2[e])

    @property
    def num_experts(self) -> int:
        return int(self.w13.shape[0])

    def packed(self, e: int) -> tuple[object | None, object | None]:
        """Expert ``e``'s packed gate/up and down weights (``None``: the dense slices)."""
        if not self.packed13:
            return None, None
        return self.packed13[e], self.packed2[e]


@dataclass
class LoraBatch:
    """Which LoRA adapter slot each row of a step uses. ``groups``: per slot in use, its rows
    (a ``slice`` when contiguous, else int64 indices), base-model rows in none; ``None`` in a
    captured decode graph (read ``row_slots`` then). ``row_slots``: ``[>= T]`` int64, the slot
    of every row, ``-1`` the base model (a graph's static input on CUDA; rows past ``T``
    ignored)."""

    groups: list[tuple[int, slice | torch.Tensor]] | None
    row_slots: torch.Tensor


class Backend(ABC):
    """The ops of a forward pass and of sampling; each docstring is every backend's contract."""

    name: str = "abstract"
    # sample batched on the device (model_shards.worker.sampling_batch), not row by row on host
    samples_on_device: bool = False
    # K/V pools of float8_e4m3fn holding k / k_scale, v / v_scale (KVPool's per-layer scales)
    fp8_kv: bool = False
    # the device runs queued work while the host goes on (so async scheduling pays by default)
    queues_work: bool = False
    # LoRA's b stored as [S, R, out] (model_shards.layers.lora): add_lora's b is its view
    lora_b_by_rank: bool = False

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

    def gated_linear(self, x: torch.Tensor, weight: torch.Tensor, packed: object) -> torch.Tensor:
        """``x [T, in]``, ``weight [2I, in]`` (gate rows, then up rows; ``packed``:
        ``pack_linear(weight)``) → ``silu(gate) * up: [T, I]``: :meth:`linear` without a bias,
        then :meth:`silu_and_mul` (a backend may fuse them, summing the GEMM in its own order
        as :meth:`linear` may)."""
        return self.silu_and_mul(self.linear(x, weight, packed, None))

    # ---- attention -------------------------------------------------------------------
    @abstractmethod
    def rotary_and_cache(
        self,
        qkv: torch.Tensor,
        step: RotaryStep,
        pool: KVPool,
        heads: tuple[int, int],
        norms: HeadNorms | None = None,
    ) -> torch.Tensor:
        """``qkv: [T, (nh + 2 nkv) * D]``, ``heads = (nh, nkv)`` → rotated ``q: [T, nh, D]``.

        With ``norms``, first each q and k head is RMS-normalized over its ``D``
        (:meth:`normalize_heads`). RoPE (half-split layout) on q and k at
        ``step.positions``; k and v are stored in ``pool`` at ``step.slot_mapping``
        (negative: padding, not stored). ``qkv`` may be rotated in place and ``q`` be a
        view of it."""

    def normalize_heads(self, qkv: torch.Tensor, heads: tuple[int, int], norms: HeadNorms) -> None:
        """In place: each q head of ``qkv [T, (nh + 2 nkv) * D]`` becomes
        ``rms_norm(head, None, norms.q, norms.eps)``, each k head likewise with ``norms.k``
        (:meth:`rms_norm`'s rounding); v untouched."""
        (nh, nkv), d = heads, norms.q.shape[0]
        q, k, _v = qkv.split([nh * d, nkv * d, nkv * d], dim=-1)  # views of qkv
        for x, weight in ((q, norms.q), (k, norms.k)):
            x.copy_(self.rms_norm(x.reshape(-1, d), None, weight, norms.eps)[0].view_as(x))

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

        Scores ``s = scale * q·k``, squashed to ``softcap * tanh(s / softcap)`` if given
        (Gemma 2), softmax in float32. Row ``b`` attends to positions
        ``0 .. meta.context_lens[b] - 1`` (the last ``meta.window`` of them with a window);
        query head ``h`` reads KV head ``h // (nh / nkv)``; a row of length 0 answers zeros.
        Kernels size their grid by ``meta.max_context_len`` rather than read the device."""

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
        """Causal attention of a step's prefill chunks (:class:`PrefillMeta`): reads their rows
        of ``q: [T, nh, D]``, writes the same rows of ``out: [T, nh, D]`` and no others;
        ``softcap`` as in :meth:`decode_attention`."""

    # ---- GEMM ------------------------------------------------------------------------
    def pack_linear(self, weight: torch.Tensor) -> object | None:
        """A faster layout of ``weight [out, in]`` for :meth:`linear`; ``None``: use the dense."""
        return None

    @abstractmethod
    def linear(
        self, x: torch.Tensor, weight: torch.Tensor, packed: object, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """``x [T, in]`` → ``x W^T + b: [T, out]``; ``packed``: ``pack_linear(weight)``."""

    def add_lora(
        self,
        y: torch.Tensor,
        x: torch.Tensor,
        a: torch.Tensor,
        b: torch.Tensor,
        batch: LoraBatch,
        cols: torch.Tensor | None = None,
    ) -> None:
        """Multi-LoRA (Punica's shrink then expand), in place: each row ``t`` of ``y [T, out]``
        with slot ``s >= 0`` gains ``(x_t a_s^T) b_s^T``; ``x [T, in]``, ``a [slots, R, in]``,
        ``b [slots, out, R]`` (the adapter's scale folded into ``b``; a view of ``[slots, R,
        out]`` where :attr:`lora_b_by_rank`). ``cols``: ``[slots, R, 2]`` int64 or ``None``, a
        promise that ``b[s, :, r]`` is zero outside outputs ``cols[s, r, 0] <= o < cols[s, r,
        1]`` (a fused layer's block-diagonal ``b``, unused ranks), which a backend may skip."""
        raise NotImplementedError(f"{self.name}: no LoRA")

    # ---- quantized weights (model_shards.quant) ---------------------------------------
    def quantized_types(self) -> frozenset[GGMLType]:
        """The GGML block types whose weights layers hold quantized for this backend's
        :meth:`quantized_linear`; others are dequantized at load (none by default)."""
        return frozenset()

    def pack_quantized(self, weight: QuantizedWeight) -> bool:
        """After loading: lay ``weight``'s blocks out (in place) for :meth:`quantized_linear`,
        e.g. as row panels (:meth:`QuantizedWeight.to_panels`); ``True`` if it did."""
        return False

    def quantized_linear(
        self, x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """``x [T, in]`` → ``x W^T + b: [T, out]`` in ``x.dtype``, ``W`` the quantized weight's
        dequantized values (rows no segment covers: zero). A backend may quantize ``x`` per
        block for integer dot products: its error bound is then the backend's to state."""
        raise NotImplementedError(f"{self.name}: no quantized weights")

    def quantized_embedding(
        self, ids: torch.Tensor, weight: QuantizedWeight, dtype: torch.dtype
    ) -> torch.Tensor:
        """``ids [T]`` int64 (in range) → the dequantized rows ``[T, in]`` in ``dtype``."""
        raise NotImplementedError(f"{self.name}: no quantized weights")

    # ---- checkpoint-quantized weights (model_shards.quant.int4, .fp8) -----------------------
    def int4_linear(
        self, x: torch.Tensor, weight: Int4GroupWeight, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """``x [T, in]`` → ``x W^T + b: [T, out]`` in ``x.dtype``, ``W = weight.dequantize()``
        (W4A16: ``x`` is not quantized)."""
        raise NotImplementedError(f"{self.name}: no 4-bit weights")

    def fp8_linear(
        self, x: torch.Tensor, weight: Fp8Weight, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """``x [T, in]`` → ``x̂ W^T + b: [T, out]`` in ``x.dtype``, ``x̂`` the activations
        rounded to FP8 (``quant.fp8.quantize_activations``), ``W = weight.dequantize()``."""
        raise NotImplementedError(f"{self.name}: no FP8 weights")

    def prepare_checkpoint_weight(
        self, weight: CheckpointWeight, dtype: torch.dtype
    ) -> CheckpointWeight | QuantizedWeight | torch.Tensor:
        """After loading: the form this backend computes a checkpoint-quantized weight in:
        ``weight`` itself (each part through :meth:`int4_linear` / :meth:`fp8_linear`; the
        default), GGML blocks (:meth:`quantized_linear`) or a dense ``[out, in]`` tensor in
        ``dtype`` (:meth:`linear`)."""
        return weight

    # ---- mixture of experts ---------------------------------------------------------
    @abstractmethod
    def fused_moe(
        self,
        x: torch.Tensor,
        experts: ExpertWeights,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
    ) -> torch.Tensor:
        """``x [T, H]``, ``topk_ids [T, k]`` int64 into this rank's experts (``-1``: another
        rank's, skipped), ``topk_weights [T, k]`` float32 → ``[T, H]`` in ``x.dtype``:
        ``out[t] = sum_j w[t, j] * down_e(silu(gate_e x[t]) * up_e x[t])``, ``e = ids[t, j]``,
        summed in float32 in ascending expert order, rounded once; no local expert: zeros.
        Where the backend's GEMM is row-independent (cpu packed), so is this."""

    # ---- sampling --------------------------------------------------------------------
    @abstractmethod
    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """``x: [S, V]`` → ``[S]`` int64, torch.argmax's answer (first maximum; a NaN wins)."""

    @abstractmethod
    def exponential_race(self, probs: torch.Tensor, seeds: torch.Tensor) -> torch.Tensor:
        """One draw per row of ``probs [S, V]`` (float32, ≥ 0), ``seeds [S]`` int64 → ``[S]``
        int64: ``argmin_i -log(u_i) / p_i`` with the uniforms of
        :func:`model_shards.backends.reference.race_uniforms`; no positive mass: 0."""

    # ---- whole steps -------------------------------------------------------------------
    def decode_stack(self, layers: list[DecodeLayerParts]) -> DecodeStack | None:
        """These plain layers' decode steps in one call (:mod:`.decode_stack`), the same bits
        as their modules; ``None`` (the default): the modules run them."""
        return None

    # ---- step lifecycle ----------------------------------------------------------------
    def graph_backend(self) -> GraphBackend | None:
        """What captures and replays decode steps as graphs; ``None``: steps run eagerly."""
        return None

    def decode_context_bounds(self, rows: int, kv_heads: int, max_context: int) -> list[int]:
        """The ``DecodeMeta.max_context_len`` bounds, ascending, the last ``max_context``,
        to capture a ``rows``-row decode graph at (a step replays the smallest holding its
        longest context): where decode attention's launch depends on the bound."""
        return [max_context]

    def to_host(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` copied to the host without waiting for the device; read it after the call
        :meth:`host_fence` returns has returned. A backend on the host returns ``x``."""
        return x

    def host_fence(self) -> Callable[[], None]:
        """After :meth:`to_host` copies: a call that waits for them, not for work queued later."""
        return _done

    def synchronize(self) -> None:  # noqa: B027 (a no-op unless the device queues work)
        """Wait for queued device work (a no-op on CPU)."""


def _done() -> None:
    """A fence already passed."""
