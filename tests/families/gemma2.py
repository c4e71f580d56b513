"""Tiny random Gemma 2 (``Gemma2ForCausalLM``): sliding-window layers alternating with global
ones, attention and final-logit soft-capping, ``(1 + w)`` norms before and after each
sub-block, embeddings scaled by sqrt(hidden), GELU-tanh MLP, ``query_pre_attn_scalar``.

=============  ====================================================================
hidden         72, 4 query heads x head_dim 32 (not 72 / 4 = 18)
kv heads       2 (GQA; tp=2: one per rank)
intermediate   110 (55 per rank at tp=2)
layers         4: sliding, global, sliding, global (two KV groups of two; pp=2: 2 + 2)
window         6 tokens (every test prompt plus its output is longer)
soft-caps      attention 20, final logits 15 (low enough to bend random logits)
vocab          499 (prime: tp=2 splits it unevenly)
lm_head        tied to embed_tokens
=============  ====================================================================

Weights are redrawn like the other tiny checkpoints (``tests/checkpoints.py``). The chat
template is Gemma's (``<start_of_turn>user ... <end_of_turn>``, no system role).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import transformers

from tests.families._gemma_common import build_gemma

NAME = "gemma2"
VOCAB_SIZE = 499
MAX_POSITIONS = 256
WINDOW = 6


def config(**overrides: Any) -> transformers.Gemma2Config:
    """The tiny Gemma 2 of the module table; ``overrides`` replace any field."""
    fields: dict[str, Any] = {
        "dtype": "float32",
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 72,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "intermediate_size": 110,
        "num_hidden_layers": 4,
        "max_position_embeddings": MAX_POSITIONS,
        "sliding_window": WINDOW,
        "query_pre_attn_scalar": 24,
        "attn_logit_softcapping": 20.0,
        "final_logit_softcapping": 15.0,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    }
    return transformers.Gemma2Config(**{**fields, **overrides})


def build(path: Path, **overrides: Any) -> Path:
    """Write the tiny random Gemma 2 and its tokenizer into ``path``; returns ``path``."""
    return build_gemma(path, transformers.Gemma2ForCausalLM(config(**overrides)), seed=2002)
