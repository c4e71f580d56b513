"""The ``cpu`` backend: the fused C++ kernels of ``model_shards/kernels`` (built by
:mod:`.cpu_build`) and a packed GEMM for every linear layer.

Chosen for CPU ranks in float32 and bfloat16 when the kernels build; each op rounds
like the reference backend and computes every row on its own, so outputs do not
depend on batch composition. Prefill attention is the reference's (one SDPA per
chunk, which PyTorch's CPU kernels already run well).

GEMM: F.linear hands MKL a plain row-major ``W`` on every call; for the short, wide
products of decoding (a few dozen rows against a large matrix) that runs at a third
to a half of the machine's matmul peak. :meth:`CpuBackend.pack_linear` reorders each
``W`` once, after loading:

* float32 on AVX-512 and bfloat16 on AVX-512 BF16: our own GEMM
  (``kernels/gemm_avx512.cpp``), 10-25% faster than oneDNN's on decode-sized batches
  and as fast on prefill;
* otherwise: oneDNN's blocked layout, 1.5-3x faster than F.linear on decode-sized
  batches.

Either way the result of a row does not depend on the other rows of the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from model_shards.backends.base import DecodeMeta, KVPool, RotaryStep
from model_shards.backends.reference import ReferenceBackend


@dataclass(frozen=True)
class PackedGemm:
    """A weight reordered for one of the two packed GEMMs."""

    data: torch.Tensor
    out_features: int  # > 0: our own GEMM's panels; 0: oneDNN's blocked layout


def _onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


class CpuBackend(ReferenceBackend):
    """Requires :func:`model_shards.backends.cpu_build.build_and_load` to have succeeded."""

    name = "cpu"

    def __init__(self) -> None:
        self._ops = torch.ops.shardserve_cpu

    def rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        y = self._ops.rms_norm(x, residual, weight, eps)  # residual updated in place
        return y, residual if residual is not None else x

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        return self._ops.silu_and_mul(x)

    def rotary_and_cache(
        self, qkv: torch.Tensor, step: RotaryStep, pool: KVPool, heads: tuple[int, int]
    ) -> torch.Tensor:
        qkv = qkv.contiguous()
        rows = (step.positions, step.cos_cached, step.sin_cached)
        self._ops.rotary_and_cache(qkv, *rows, pool.k, pool.v, step.slot_mapping, *heads)
        return qkv.view(qkv.shape[0], -1, pool.k.shape[-1])[:, : heads[0]]  # rotated in place

    def decode_attention(
        self, q: torch.Tensor, pool: KVPool, meta: DecodeMeta, scale: float
    ) -> torch.Tensor:
        tables, lens = meta.block_tables, meta.context_lens
        return self._ops.decode_attention(q, pool.k, pool.v, tables, lens, pool.block_size, scale)

    def pack_linear(self, weight: torch.Tensor) -> PackedGemm | None:
        weight = weight.detach()
        if bool(self._ops.gemm_vectorized(weight.dtype)):
            return PackedGemm(self._ops.pack_gemm(weight), weight.shape[0])
        if _onednn_available():
            return PackedGemm(torch.ops.mkldnn._reorder_linear_weight(weight, None), 0)
        return None

    def linear(
        self, x: torch.Tensor, weight: torch.Tensor, packed: object, bias: torch.Tensor | None
    ) -> torch.Tensor:
        if not isinstance(packed, PackedGemm):
            return super().linear(x, weight, packed, bias)
        if packed.out_features:
            return self._ops.gemm(x, packed.data, packed.out_features, bias)
        return torch.ops.mkldnn._linear_pointwise(x, packed.data, bias, "none", [], "")

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        return self._ops.argmax(x if x.stride(-1) == 1 else x.contiguous())

    def exponential_race(self, probs: torch.Tensor, seeds: torch.Tensor) -> torch.Tensor:
        probs = probs.float()
        probs = probs if probs.stride(-1) == 1 else probs.contiguous()
        return self._ops.exponential_race(probs, seeds)
