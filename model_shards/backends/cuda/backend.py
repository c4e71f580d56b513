"""The ``cuda`` backend: Triton kernels for every op but the dense GEMMs (cuBLAS through
F.linear), and the draw of sampling on the device.

* attention: paged decode attention with GQA (single pass, or split over the context
  for long sequences when the batch leaves SMs idle: flash-decoding; decode graphs are
  captured per context bound where that split would happen), one varlen launch for all
  prefill chunks of a step over the paged pool, RoPE fused with the K/V write (and with
  per-head q/k RMSNorms, Qwen3's); sliding windows (a windowed row reads only its window)
  and soft-capped scores (Gemma) in the same kernels;
* FP8 K/V pools (``--kv-cache-dtype fp8``): e4m3 with per-tensor scales (``KVPool.k_scale``,
  ``v_scale``), written by the rotary kernel and dequantized on load in the tile by both
  attention kernels (``e4m3.py``);
* RMSNorm with the residual add; SiLU-and-mul, or (opt-in, decode-sized steps) the gate/up
  GEMM with SiLU-and-mul in its epilogue (``gate_up.py``); the position-seeded exponential
  race;
* 4-bit AWQ/GPTQ weights (:class:`~model_shards.quant.int4.Int4GroupWeight`): a W4A16 GEMM
  dequantizing in the tile, split-K for decode, a fixed summation order (``int4_gemm.py``);
* FP8 W8A8 weights (:class:`~model_shards.quant.fp8.Fp8Weight`): activations rounded to e4m3
  per token in Triton, then ``torch._scaled_mm`` (cuBLASLt, row-wise scales) on sm89+ GPUs,
  else (and with ``--batch-invariant``) a Triton FP8 GEMM of fixed tiles (``fp8_gemm.py``);
* GGUF block-quantized weights: no kernel yet: :meth:`CudaBackend.quantized_types` keeps
  none, so layers dequantize them to the model dtype at load (logged once per type);
* MoE experts: sparse grouped GEMMs (``fused_moe.py``): the (token, expert) pairs sorted
  and padded per expert into row blocks in torch (``moe_align.py``), gate/up with
  SiLU-and-mul, down times the routing weight, then each token's sum in expert order; only
  the routed experts' weights are read, and no shape depends on the routing, so decode
  graphs capture it;

``batch_invariant=True`` (``--batch-invariant``) replaces cuBLAS with a Triton GEMM
of fixed tiles and reduction order and keeps decode attention single-pass, so a row's
output does not depend on its batch (see docs/deploy.md for what holds on GPU).
The kernels also run in Triton's interpreter on CPU tensors, which is how they are
tested without a GPU.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from model_shards.backends.base import (
    DecodeMeta,
    ExpertWeights,
    HeadNorms,
    KVPool,
    LoraBatch,
    PrefillMeta,
    RotaryStep,
)
from model_shards.backends.cuda.graphs import CudaGraphBackend, GraphBackend
from model_shards.backends.cuda.triton_ops import (
    activation,
    attention_decode,
    attention_prefill,
    fp8_gemm,
    fused_moe,
    gate_up,
    gemm,
    int4_gemm,
    lora,
    norm,
    rotary,
    sampling,
)
from model_shards.backends.reference import ReferenceBackend
from model_shards.quant.formats import GGMLType
from model_shards.quant.fp8 import Fp8Weight
from model_shards.quant.int4 import Int4GroupWeight

FUSED_GATE_UP_ENV = "SHARDSERVE_FUSED_GATE_UP"  # "1": the fused gate/up + SiLU-and-mul GEMM


class CudaBackend(ReferenceBackend):
    name = "cuda"
    samples_on_device = True
    queues_work = True

    def __init__(self, batch_invariant: bool = False, fused_gate_up: bool | None = None) -> None:
        self.batch_invariant = batch_invariant
        if fused_gate_up is None:
            fused_gate_up = os.environ.get(FUSED_GATE_UP_ENV) == "1"
        self.fused_gate_up = fused_gate_up
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.fp8_operand = fp8_gemm.fp8_operand(device)  # "fp8" on sm89+ GPUs
        self.fp8_scaled_mm = self.fp8_operand == "fp8" and not batch_invariant
        self.num_sms = attention_decode.device_sms(device)  # decode attention's split

    def rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return norm.rms_norm(x, residual, weight, eps)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        return activation.silu_and_mul(x)

    def gated_linear(self, x: torch.Tensor, weight: torch.Tensor, packed: object) -> torch.Tensor:
        """With ``SHARDSERVE_FUSED_GATE_UP=1`` (off until a GPU run shows it faster than
        cuBLAS + ``silu_and_mul``): decode-sized steps in one Triton GEMM with SiLU-and-mul
        in its epilogue (``gate_up.py``); else, and with ``--batch-invariant``, unfused."""
        if self.fused_gate_up and not self.batch_invariant and gate_up.takes(x, weight):
            return gate_up.gate_up_silu(x, weight)
        return super().gated_linear(x, weight, packed)

    def add_lora(
        self,
        y: torch.Tensor,
        x: torch.Tensor,
        a: torch.Tensor,
        b: torch.Tensor,
        batch: LoraBatch,
        cols: torch.Tensor | None = None,
    ) -> None:
        lora.add_lora(y, x, a, b, batch.row_slots)

    def rotary_and_cache(
        self,
        qkv: torch.Tensor,
        step: RotaryStep,
        pool: KVPool,
        heads: tuple[int, int],
        norms: HeadNorms | None = None,
    ) -> torch.Tensor:
        """One Triton launch: q/k head norms (if any), RoPE, the K/V write."""
        rows = (step.positions, step.cos_cached, step.sin_cached)
        scales = (pool.k_scale, pool.v_scale)
        weights = None if norms is None else (norms.q, norms.k, norms.eps)
        return rotary.rotary_and_cache(
            qkv, *rows, pool.k, pool.v, step.slot_mapping, *heads, kv_scales=scales, norms=weights
        )

    def decode_attention(
        self,
        q: torch.Tensor,
        pool: KVPool,
        meta: DecodeMeta,
        scale: float,
        softcap: float | None = None,
    ) -> torch.Tensor:
        tables, lens, bound = meta.block_tables, meta.context_lens, meta.max_context_len
        return attention_decode.decode_attention(
            q,
            pool.k,
            pool.v,
            tables,
            lens,
            pool.block_size,
            scale,
            max_context_len=bound,
            batch_invariant=self.batch_invariant,
            window=meta.window,
            softcap=softcap,
            kv_scales=(pool.k_scale, pool.v_scale),
            num_sms=self.num_sms,
        )

    def prefill_attention(
        self,
        q: torch.Tensor,
        pool: KVPool,
        meta: PrefillMeta,
        scale: float,
        out: torch.Tensor,
        softcap: float | None = None,
    ) -> None:
        scales = (pool.k_scale, pool.v_scale)
        attention_prefill.prefill_attention(
            q, pool.k, pool.v, meta, scale, out, softcap, kv_scales=scales
        )

    def quantized_types(self) -> frozenset[GGMLType]:
        return frozenset()  # dequantized to the model dtype at load until a GPU kernel exists

    def linear(
        self, x: torch.Tensor, weight: torch.Tensor, packed: object, bias: torch.Tensor | None
    ) -> torch.Tensor:
        if self.batch_invariant:
            return gemm.linear(x, weight, bias)
        return super().linear(x, weight, packed, bias)

    def int4_linear(
        self, x: torch.Tensor, weight: Int4GroupWeight, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """The Triton W4A16 GEMM (dequantized in the tile, split-K for few output tiles)."""
        return int4_gemm.int4_linear(x, weight, bias, batch_invariant=self.batch_invariant)

    def fp8_linear(
        self, x: torch.Tensor, weight: Fp8Weight, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """Activations to e4m3 per token (or the static scale) in Triton, then cuBLASLt's
        row-scaled FP8 GEMM (bfloat16 ``x``, K and N multiples of 16, an FP8 GPU, not
        ``--batch-invariant``), else the Triton FP8 GEMM of fixed tiles."""
        scales = (weight.input_scale, weight.input_scale_ub)
        xq, x_scale = fp8_gemm.quantize_rows(x, *scales)  # [T, in] e4m3, [T]
        k, n = weight.in_features, weight.out_features
        if self.fp8_scaled_mm and x.dtype == torch.bfloat16 and k % 16 == 0 and n % 16 == 0:
            return fp8_gemm.scaled_mm(xq, x_scale, weight, bias)
        return fp8_gemm.fp8_matmul(xq, x_scale, weight, bias, x.dtype, self.fp8_operand)

    def exponential_race(self, probs: torch.Tensor, seeds: torch.Tensor) -> torch.Tensor:
        return sampling.exponential_race(probs, seeds)

    def fused_moe(
        self,
        x: torch.Tensor,
        experts: ExpertWeights,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
    ) -> torch.Tensor:
        """The routed experts only, as Triton grouped GEMMs (``triton_ops/fused_moe.py``);
        graph-capturable (no shape depends on the routing)."""
        return fused_moe.fused_moe(
            x, experts.w13, experts.w2, topk_weights, topk_ids, self.batch_invariant
        )

    def graph_backend(self) -> GraphBackend | None:
        if not torch.cuda.is_available():
            return None  # Triton's interpreter on CPU tensors (tests): nothing to capture
        return CudaGraphBackend()

    def decode_context_bounds(self, rows: int, kv_heads: int, max_context: int) -> list[int]:
        """Where decode attention would split the longest context, several bounds
        (:func:`~.triton_ops.attention_decode.graph_context_bounds`): a short step replays
        the single pass, a long one partitions sized by its bound, not by the model's."""
        return attention_decode.graph_context_bounds(
            rows, kv_heads, max_context, self.batch_invariant, self.num_sms
        )

    def to_host(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "cuda":
            return x
        return torch.empty(x.shape, dtype=x.dtype, pin_memory=True).copy_(x, non_blocking=True)

    def host_fence(self) -> Callable[[], None]:
        if not torch.cuda.is_available():
            return super().host_fence()
        event = torch.cuda.Event()
        event.record()
        return event.synchronize

    def synchronize(self) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
