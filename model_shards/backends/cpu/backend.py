"""The ``cpu`` backend: the C++ kernels of :mod:`.build` for every op and a packed GEMM.

Each op rounds like the reference backend and computes every row on its own, so outputs do not
depend on batch composition.

GEMM: F.linear hands MKL a row-major ``W`` on every call, which for the short, wide products of
decoding runs at a third to a half of matmul peak; :meth:`CpuBackend.pack_linear` reorders each
``W`` once after loading, for our own GEMM (``kernels/gemm.cpp``) or oneDNN's blocked layout.

Quantized weights (:meth:`CpuBackend.quantized_linear`): every GGML block type stays in its
blocks; ``kernels/quant_gemm.cpp`` multiplies them with per-block int8 activations, one call per
segment of the weight (a fused layer's parts may differ in type) into its output columns. With
AVX-512 VNNI, :meth:`CpuBackend.pack_quantized` lays each segment out as row panels after loading
(the same bytes, sixteen rows interleaved: :mod:`model_shards.quant.panels`), which
``kernels/quant_panels.cpp`` multiplies 1.3-2.5x faster with the same bits.

Checkpoint-quantized weights (:meth:`CpuBackend.prepare_checkpoint_weight`), at load: 4-bit
groups of a multiple of 32 become Q4_0 / Q4_1 blocks (:mod:`model_shards.quant.int4_ggml`: exact
for symmetric weights, Q4_1's offset rounded to float16) for the kernels above; other 4-bit
weights (act-order, odd groups) are dequantized in each product (the reference's
``int4_linear``). FP8 weights are dequantized to the model dtype: served W8A16, the activations
not rounded to FP8 (closer to the unquantized model than W8A8, and the dense GEMM is the fast
one here).

MoE (:meth:`CpuBackend.fused_moe`): the (token, expert) pairs sorted by expert, one packed GEMM
per expert for gate/up and for down, one SiLU-and-mul over all rows, one weighted scatter-add.
"""

from __future__ import annotations

import logging
from functools import cache

import torch
import torch.nn.functional as F

from model_shards.backends.base import (
    DecodeMeta,
    ExpertWeights,
    HeadNorms,
    KVPool,
    LoraBatch,
    PrefillMeta,
    RotaryStep,
)
from model_shards.backends.cpu.build import KERNEL_DTYPES
from model_shards.backends.cpu.decode_stack import CpuDecodeStack, build_decode_stack
from model_shards.backends.cpu.packed_gemm import PackedGemm
from model_shards.backends.decode_stack import DecodeLayerParts
from model_shards.backends.reference import ReferenceBackend
from model_shards.quant.checkpoint_weight import CheckpointWeight
from model_shards.quant.formats import BLOCK_TYPES, FLOAT_TYPES, GGMLType
from model_shards.quant.fp8 import Fp8Weight
from model_shards.quant.int4 import Int4GroupWeight
from model_shards.quant.int4_ggml import to_ggml
from model_shards.quant.weights import QuantizedTensor, QuantizedWeight

log = logging.getLogger(__name__)


@cache
def _log_once(message: str) -> None:
    log.info(message)


def _onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


class CpuBackend(ReferenceBackend):
    """Requires :func:`model_shards.backends.cpu.build.build_and_load` to have succeeded."""

    name = "cpu"
    fp8_kv = False  # the C++ attention kernels read float pools
    lora_b_by_rank = True  # kernels/lora.cpp's expand reads each rank's outputs in a row

    def __init__(self) -> None:
        self._ops = torch.ops.shardserve_cpu
        self._panels = bool(self._ops.quant_panels_isa())
        self._no_cols = torch.empty(0, dtype=torch.int64)  # lora_add: every column

    def rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        y = self._ops.rms_norm(x, residual, weight, eps)  # residual updated in place
        return y, residual if residual is not None else x

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        return self._ops.silu_and_mul(x)

    def rotary_and_cache(
        self,
        qkv: torch.Tensor,
        step: RotaryStep,
        pool: KVPool,
        heads: tuple[int, int],
        norms: HeadNorms | None = None,
    ) -> torch.Tensor:
        if norms is not None:
            self.normalize_heads(qkv, heads, norms)
        qkv = qkv.contiguous()
        rows = (step.positions, step.cos_cached, step.sin_cached)
        self._ops.rotary_and_cache(qkv, *rows, pool.k, pool.v, step.slot_mapping, *heads)
        return qkv.view(qkv.shape[0], -1, pool.k.shape[-1])[:, : heads[0]]  # rotated in place

    def decode_attention(
        self,
        q: torch.Tensor,
        pool: KVPool,
        meta: DecodeMeta,
        scale: float,
        softcap: float | None = None,
    ) -> torch.Tensor:
        tables, lens, bs = meta.block_tables, meta.context_lens, pool.block_size
        window, cap = meta.window or 0, softcap or 0.0  # 0: none
        return self._ops.decode_attention(
            q, pool.k, pool.v, tables, lens, bs, scale, True, window, cap
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
        """The C++ kernel; soft-capped scores (Gemma 2) take the reference's path."""
        if softcap is not None:
            super().prefill_attention(q, pool, meta, scale, out, softcap)
            return
        self._ops.prefill_attention(
            q,
            pool.k,
            pool.v,
            out,
            meta.block_tables,
            meta.q_starts,
            meta.q_lens,
            meta.start_positions,
            meta.block_size,
            scale,
            meta.window or 0,  # 0: none
        )

    def pack_linear(self, weight: torch.Tensor) -> PackedGemm | None:
        """Our GEMM's panels on AVX-512, or on AVX2 in bfloat16 (oneDNN has no bfloat16 GEMM
        there); oneDNN's layout for float32 on AVX2 (~15% faster than our AVX2 tiles)."""
        weight = weight.detach()
        isa = str(self._ops.gemm_isa(weight.dtype))
        onednn = _onednn_available()
        if isa == "avx512" or (isa == "avx2" and (weight.dtype == torch.bfloat16 or not onednn)):
            return PackedGemm(self._ops.pack_gemm(weight), weight.shape[0])
        if onednn:
            try:
                return PackedGemm(torch.ops.mkldnn._reorder_linear_weight(weight, None), 0)
            except RuntimeError:  # e.g. bfloat16 on a CPU without avx512bw / avx_ne_convert
                return None
        return None

    def linear(
        self, x: torch.Tensor, weight: torch.Tensor, packed: object, bias: torch.Tensor | None
    ) -> torch.Tensor:
        if not isinstance(packed, PackedGemm):
            return super().linear(x, weight, packed, bias)
        if packed.out_features:
            return self._ops.gemm(x, packed.data, packed.out_features, bias)
        return torch.ops.mkldnn._linear_pointwise(x, packed.data, bias, "none", [], "")

    def quantized_types(self) -> frozenset[GGMLType]:
        return BLOCK_TYPES

    def pack_quantized(self, weight: QuantizedWeight) -> bool:
        return self._panels and weight.to_panels(BLOCK_TYPES)

    def add_lora(
        self,
        y: torch.Tensor,
        x: torch.Tensor,
        a: torch.Tensor,
        b: torch.Tensor,
        batch: LoraBatch,
        cols: torch.Tensor | None = None,
    ) -> None:
        """One native call a layer (``kernels/lora.cpp``): each row's shrink and expand over
        ``b``'s rank-major storage (:attr:`lora_b_by_rank`), skipping what ``cols`` rules
        out."""
        if x.dtype not in KERNEL_DTYPES or y.stride(1) != 1:
            super().add_lora(y, x, a, b, batch, cols)
            return
        bt = b.transpose(1, 2).contiguous()  # [S, R, out]: a view (no copy) of our own b
        spans = self._no_cols if cols is None else cols
        self._ops.lora_add(y, x.contiguous(), a.contiguous(), bt, spans, batch.row_slots)

    def decode_stack(self, layers: list[DecodeLayerParts]) -> CpuDecodeStack | None:
        return build_decode_stack(layers)

    def prepare_checkpoint_weight(
        self, weight: CheckpointWeight, dtype: torch.dtype
    ) -> CheckpointWeight | QuantizedWeight | torch.Tensor:
        """FP8: dense in ``dtype``; 4-bit: Q4_0 / Q4_1 blocks where every part converts, else
        as is (the module docstring)."""
        parts = [p for _, p in weight.parts]
        if weight.covers_all and all(isinstance(p, Fp8Weight) for p in parts):
            _log_once(f"cpu backend: FP8 weights dequantized at load to {dtype}")
            return weight.dequantize().to(dtype)
        blocks = [to_ggml(p) if isinstance(p, Int4GroupWeight) else None for p in parts]
        if not all(b is not None for b in blocks):
            _log_once(
                "cpu backend: 4-bit weights with act-order or groups not a multiple of 32 "
                "are dequantized in each product"
            )
            return weight
        held = QuantizedWeight(weight.out_features, weight.in_features)
        for (start, _), tensor in zip(weight.parts, blocks, strict=True):
            assert tensor is not None
            held.add(start, tensor)
        return held

    def quantized_linear(
        self, x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """One ``quant_gemm`` per segment (float segments: F.linear), each into its columns."""
        segments = weight.segments
        if len(segments) == 1 and segments[0].tensor.rows == weight.out_features:
            return self._segment(x, segments[0].tensor, bias)
        out = x.new_zeros(*x.shape[:-1], weight.out_features)  # [T, out]
        for seg in segments:
            b = None if bias is None else bias[seg.start : seg.end]
            out[..., seg.start : seg.end] = self._segment(x, seg.tensor, b)
        if bias is not None and not weight.covers_all:
            covered = torch.zeros(weight.out_features, dtype=torch.bool)
            for seg in segments:
                covered[seg.start : seg.end] = True
            out[..., ~covered] += bias[~covered]
        return out

    def _segment(
        self, x: torch.Tensor, tensor: QuantizedTensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        if tensor.qtype in FLOAT_TYPES:
            return F.linear(x, tensor.dequantize().to(x.dtype), bias)
        x = x if x.stride(-1) == 1 else x.contiguous()
        b = None if bias is None else bias.contiguous()
        if tensor.panels:
            return self._ops.quant_gemm_panels(x, tensor.data, int(tensor.qtype), b)
        return self._ops.quant_gemm(x, tensor.data, int(tensor.qtype), b)

    def fused_moe(
        self,
        x: torch.Tensor,
        experts: ExpertWeights,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
    ) -> torch.Tensor:
        k = topk_ids.shape[1]
        flat = topk_ids.reshape(-1)  # [T k]
        # [1 + E]: pairs of remote experts (-1), then of each local expert
        counts = torch.bincount(flat + 1, minlength=experts.num_experts + 1).tolist()
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)  # [T, H]
        if counts[0] == flat.numel():
            return out.to(x.dtype)
        order = torch.argsort(flat, stable=True)[counts[0] :]  # [N] local pairs by expert
        rows = order // k  # [N] each pair's token
        spans, start = [], 0
        for e, n in enumerate(counts[1:]):
            if n:
                spans.append((e, start, start + n))
            start += n
        gate_up = self._per_expert(x.index_select(0, rows), experts.w13, experts, spans)
        y = self._per_expert(self.silu_and_mul(gate_up), experts.w2, experts, spans)  # [N, H]
        out.index_add_(0, rows, y.float() * topk_weights.reshape(-1)[order, None])
        return out.to(x.dtype)

    def _per_expert(
        self,
        rows: torch.Tensor,
        weights: torch.Tensor,
        experts: ExpertWeights,
        spans: list[tuple[int, int, int]],
    ) -> torch.Tensor:
        """``rows [N, in]`` grouped by expert (``spans``: expert, first row, end row) times
        each expert's ``weights[e]`` (``experts.w13`` or ``w2``) → ``[N, out]``."""
        which = 0 if weights is experts.w13 else 1
        parts = []
        for e, a, b in spans:
            packed = experts.packed(e)[which]
            if isinstance(packed, QuantizedWeight):  # a quantized checkpoint's GGML blocks
                parts.append(self.quantized_linear(rows[a:b], packed, None))
            else:
                parts.append(self.linear(rows[a:b], weights[e], packed, None))
        return torch.cat(parts)

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        return self._ops.argmax(x if x.stride(-1) == 1 else x.contiguous())

    def exponential_race(self, probs: torch.Tensor, seeds: torch.Tensor) -> torch.Tensor:
        probs = probs.float()
        probs = probs if probs.stride(-1) == 1 else probs.contiguous()
        return self._ops.exponential_race(probs, seeds)
