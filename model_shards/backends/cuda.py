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

from model_shards.backends.base import DecodeMeta, KVPool, PrefillMeta, RotaryStep
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
        self, qkv: torch.Tensor, step: RotaryStep, pool: KVPool, heads: tuple[int, int]
    ) -> torch.Tensor:
        rows = (step.positions, step.cos_cached, step.sin_cached)
        return rotary.rotary_and_cache(qkv, *rows, pool.k, pool.v, step.slot_mapping, *heads)

    def decode_attention(
        self, q: torch.Tensor, pool: KVPool, meta: DecodeMeta, scale: float
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
        )

    def prefill_attention(
        self, q: torch.Tensor, pool: KVPool, meta: PrefillMeta, scale: float, out: torch.Tensor
    ) -> None:
        attention_prefill.prefill_attention(q, pool.k, pool.v, meta, scale, out)

    def linear(
        self, x: torch.Tensor, weight: torch.Tensor, packed: object, bias: torch.Tensor | None
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
