"""Tiny random Qwen3-MoE (``Qwen3MoeForCausalLM``): QK-norm attention, 8 experts, top-2,
renormalised routing.

=============  ====================================================================
hidden         72, 4 query heads x head_dim 40 (not 72 / 4 = 18), q/k RMSNorm per head
kv heads       2
experts        8 per layer, top 2, softmax renormalised (norm_topk_prob true), each of
               intermediate 42 (tp=2: 21 per rank; with expert parallelism 4 whole
               experts per rank)
layers         3 (pp=2 splits 2 + 1)
vocab          499 (prime)
lm_head        tied to embed_tokens
=============  ====================================================================

Weights redrawn as in ``tests/checkpoints.py`` (``q_norm``/``k_norm`` ``1 + N(0, 0.1)``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import transformers

from model_shards.launch.default_model import BOS_TOKEN_ID, EOS_TOKEN_ID
from tests.checkpoints import randomize, write_tokenizer

NAME = "qwen3_moe"
VOCAB_SIZE = 499
MAX_POSITIONS = 256
NUM_EXPERTS = 8
LAYOUTS = [(1, 1), (2, 1), (1, 2)]  # tp=2 with expert parallelism: test_moe_parity.py


def config(**overrides: Any) -> transformers.Qwen3MoeConfig:
    """The tiny Qwen3-MoE of the module table; ``overrides`` replace any field."""
    fields: dict[str, Any] = {
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 72,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 40,
        "intermediate_size": 96,
        "moe_intermediate_size": 42,
        "num_experts": NUM_EXPERTS,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
        "num_hidden_layers": 3,
        "max_position_embeddings": MAX_POSITIONS,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
        "tie_word_embeddings": True,
        "attention_bias": False,
        "use_sliding_window": False,
        "bos_token_id": BOS_TOKEN_ID,
        "eos_token_id": EOS_TOKEN_ID,
        "pad_token_id": None,
        "dtype": "float32",
    }
    return transformers.Qwen3MoeConfig(**{**fields, **overrides})


def build(path: Path, **overrides: Any) -> Path:
    """Write the tiny random Qwen3-MoE and the test tokenizer into ``path``."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(config(**overrides))
    randomize(model, seed=6006)
    model.save_pretrained(path)
    write_tokenizer(path, qwen2_style=True)
    return path
