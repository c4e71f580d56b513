"""The ``cuda`` backend: Triton kernels for every op but the dense GEMMs (cuBLAS through
F.linear), and the draw of sampling on the device.

* attention: paged decode attention with GQA (single pass, or split over the context
  for long sequences: flash-decoding), one varlen launch for all prefill chunks of a
  step over the paged pool, RoPE fused with the K/V write;
* RMSNorm with the residual add; SiLU-and-mul; the position-seeded exponential race.

``batch_invariant=True`` (``--batch-invariant``) replaces cuBLAS with a Triton GEMM
of fixed tiles and reduction order and keeps decode attention single-pass, so a row's
output does not depend on its batch (see docs/deploy.md for what holds on GPU).
The kernels also run in Triton's interpreter on CPU tensors, which is how they are
tested without a GPU.
"""

from __future__ import annotations

import torch

from model_shards.backends.base import PrefillMeta
from model_shards.backends.cuda_graphs import CudaGraphBackend, GraphBackend
from model_shards.backends.reference import ReferenceBackend
from model_shards.backends.triton_ops import (
    activation,
    attention_decode,
    attention_prefill,
    gemm,
    norm,
    rotary,
    sampling,
)


class CudaBackend(ReferenceBackend):
    name = "cuda"
    samples_on_device = True

    def __init__(self, batch_invariant: bool = False) -> None:
        self.batch_invariant = batch_invariant

    def rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return norm.rms_norm(x, residual, weight, eps)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        return activation.silu_and_mul(x)

    def rotary_and_cache(
        self,
        qkv: torch.Tensor,
        positions: torch.Tensor,
        cos_cached: torch.Tensor,
        sin_cached: torch.Tensor,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        slot_mapping: torch.Tensor,
        num_heads: int,
        num_kv_heads: int,
    ) -> torch.Tensor:
        return rotary.rotary_and_cache(
            qkv,
            positions,
            cos_cached,
            sin_cached,
            k_pool,
            v_pool,
            slot_mapping,
            num_heads,
            num_kv_heads,
        )

    def decode_attention(
        self,
        q: torch.Tensor,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        block_size: int,
        scale: float,
        max_context_len: int | None = None,
    ) -> torch.Tensor:
        return attention_decode.decode_attention(
            q,
            k_pool,
            v_pool,
            block_tables,
            context_lens,
            block_size,
            scale,
            max_context_len=max_context_len,
            batch_invariant=self.batch_invariant,
        )

    def prefill_attention(
        self,
        q: torch.Tensor,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        meta: PrefillMeta,
        scale: float,
        out: torch.Tensor,
    ) -> None:
        attention_prefill.prefill_attention(q, k_pool, v_pool, meta, scale, out)

    def linear(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        packed: object | None,
        bias: torch.Tensor | None,
    ) -> torch.Tensor:
        if self.batch_invariant:
            return gemm.linear(x, weight, bias)
        return super().linear(x, weight, packed, bias)

    def exponential_race(self, probs: torch.Tensor, seeds: torch.Tensor) -> torch.Tensor:
        return sampling.exponential_race(probs, seeds)

    def graph_backend(self) -> GraphBackend | None:
        if not torch.cuda.is_available():
            return None  # Triton's interpreter on CPU tensors (tests): nothing to capture
        return CudaGraphBackend()

    def synchronize(self) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
