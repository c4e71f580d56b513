"""Llama shapes for ``make gpu-check`` and the arithmetic of its HBM roofline.

Decode at batch 1 is memory-bound: each step reads every weight once (the embedding
table excepted: one row is gathered per token) plus the KV cache of the context so far.
So the bytes per output token are

    bytes/token = dtype_bytes × (params − vocab × hidden)
                + dtype_bytes × 2 × layers × kv_heads × head_dim × mean_context

and the fraction of the HBM roofline reached is ``tok/s × bytes/token / peak_bw``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from model_shards.launch.default_model import DEFAULT_MODEL_CONFIG

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}

PEAK_BW_BY_NAME: tuple[tuple[str, float], ...] = (
    ("H200", 4.8e12),  # HBM3e, datasheet
    ("H100", 3.35e12),  # SXM, HBM3
    ("A100", 2.039e12),  # 80 GB SXM
)
"""Device-name substring → peak memory bandwidth (B/s); first match wins."""


@dataclass(frozen=True, slots=True)
class LlamaShape:
    """The sizes of an untied Llama (separate ``embed_tokens`` and ``lm_head``)."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    rope_theta: float = 500000.0
    max_positions: int = 8192
    rms_norm_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def layer_params(self) -> int:
        """q, k, v, o, gate, up, down and the two RMSNorm weights of one layer."""
        kv = self.kv_heads * self.head_dim
        attention = 2 * self.hidden * self.heads * self.head_dim + 2 * self.hidden * kv
        return attention + 3 * self.hidden * self.intermediate + 2 * self.hidden

    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    def total_params(self) -> int:
        """Embedding + layers + final norm + LM head."""
        return 2 * self.embedding_params() + self.layers * self.layer_params() + self.hidden

    def kv_bytes_per_position(self, dtype: str) -> int:
        """K and V of one context position over all layers."""
        return 2 * self.layers * self.kv_heads * self.head_dim * DTYPE_BYTES[dtype]

    def decode_bytes_per_token(self, dtype: str, mean_context: float) -> float:
        """HBM bytes one batch-1 decode step reads: weights bar the embedding, plus KV."""
        weights = (self.total_params() - self.embedding_params()) * DTYPE_BYTES[dtype]
        return weights + self.kv_bytes_per_position(dtype) * mean_context

    def hf_config(self, dtype: str, bos_id: int, eos_id: int) -> dict[str, Any]:
        """``config.json`` of a ``LlamaForCausalLM`` with these sizes."""
        return {
            **DEFAULT_MODEL_CONFIG,  # the same Llama config.json, these sizes
            "hidden_size": self.hidden,
            "intermediate_size": self.intermediate,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_positions,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "torch_dtype": dtype,
            "vocab_size": self.vocab,
            "bos_token_id": bos_id,
            "eos_token_id": eos_id,
        }

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "head_dim": self.head_dim, "parameters": self.total_params()}


LLAMA3_8B = LlamaShape(
    hidden=4096, layers=32, heads=32, kv_heads=8, intermediate=14336, vocab=128256
)
"""Meta-Llama-3-8B's sizes (8 030 261 248 parameters)."""

SMOKE = LlamaShape(
    hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, vocab=2048, max_positions=1024
)
"""A tiny shape for ``--smoke`` on CPU (vocab above the 1024-token tokenizer's, like 8B's)."""

SHAPES = {"llama3-8b": LLAMA3_8B, "smoke": SMOKE}


def default_peak_bw(device_name: str) -> float | None:
    """Peak HBM bandwidth (B/s) of a known GPU by its name, else ``None``."""
    for needle, bandwidth in PEAK_BW_BY_NAME:
        if needle.lower() in device_name.lower():
            return bandwidth
    return None


def roofline_fraction(tok_s: float, bytes_per_token: float, peak_bw: float) -> float:
    """Fraction of the HBM roofline: bytes moved per second over the peak."""
    if peak_bw <= 0:
        raise ValueError(f"peak bandwidth must be positive, got {peak_bw}")
    return tok_s * bytes_per_token / peak_bw
