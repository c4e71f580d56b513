"""Tiny random Gemma 3 text model (``Gemma3ForCausalLM``): Gemma 2's block with per-head
QK-norm, one rope theta per layer type, no soft-capping, head_dim 256 as released.

=============  ====================================================================
hidden         64, 2 query heads x head_dim 256
kv heads       1 (MQA: tp=2 replicates it)
intermediate   90 (45 per rank at tp=2)
layers         5: sliding, sliding, global, sliding, global (KV groups of two: one
               global, two sliding, the last with one layer; pp=2: 3 + 2)
window         7 tokens
rope theta     10 000 sliding, 1 000 000 global
vocab          499 (prime: tp=2 splits it unevenly)
lm_head        tied to embed_tokens
=============  ====================================================================
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import transformers

from tests.families._gemma_common import build_gemma

NAME = "gemma3"
VOCAB_SIZE = 499
MAX_POSITIONS = 256
WINDOW = 7
LAYER_TYPES = ["sliding_attention"] * 2 + ["full_attention", "sliding_attention", "full_attention"]


def config(**overrides: Any) -> transformers.Gemma3TextConfig:
    """The tiny Gemma 3 of the module table; ``overrides`` replace any field."""
    fields: dict[str, Any] = {
        "dtype": "float32",
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 64,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 256,
        "intermediate_size": 90,
        "num_hidden_layers": len(LAYER_TYPES),
        "layer_types": LAYER_TYPES,
        "max_position_embeddings": MAX_POSITIONS,
        "sliding_window": WINDOW,
        "query_pre_attn_scalar": 256,
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
        },
    }
    return transformers.Gemma3TextConfig(**{**fields, **overrides})


def build(path: Path, **overrides: Any) -> Path:
    """Write the tiny random Gemma 3 and its tokenizer into ``path``; returns ``path``."""
    return build_gemma(path, transformers.Gemma3ForCausalLM(config(**overrides)), seed=3303)
