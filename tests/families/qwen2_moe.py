"""Tiny random Qwen2-MoE (``Qwen2MoeForCausalLM``): 6 experts, top-2, a gated shared expert,
one dense layer.

=============  ====================================================================
hidden         80, 4 query heads x head_dim 20, q/k/v bias (qkv_bias), o without
kv heads       2
experts        6 per sparse layer, top 2, softmax not renormalised (norm_topk_prob
               false), each of intermediate 36 (tp=2: 18 per rank; with expert
               parallelism 3 whole experts per rank)
shared expert  intermediate 44, scaled by sigmoid(shared_expert_gate(x))
layers         3; layer 1 dense (mlp_only_layers [1], intermediate 100)
vocab          509 (prime)
lm_head        untied
=============  ====================================================================

Weights redrawn as in ``tests/checkpoints.py`` (biases ``N(0, 0.1)``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import transformers

from model_shards.launch.default_model import BOS_TOKEN_ID, EOS_TOKEN_ID
from tests.checkpoints import randomize, write_tokenizer

NAME = "qwen2_moe"
VOCAB_SIZE = 509
MAX_POSITIONS = 256
NUM_EXPERTS = 6
LAYOUTS = [(1, 1), (2, 1), (1, 2)]  # tp=2 with expert parallelism: test_moe_parity.py


def config(**overrides: Any) -> transformers.Qwen2MoeConfig:
    """The tiny Qwen2-MoE of the module table; ``overrides`` replace any field."""
    fields: dict[str, Any] = {
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 80,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 100,
        "moe_intermediate_size": 36,
        "shared_expert_intermediate_size": 44,
        "num_experts": NUM_EXPERTS,
        "num_experts_per_tok": 2,
        "norm_topk_prob": False,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [1],
        "num_hidden_layers": 3,
        "max_position_embeddings": MAX_POSITIONS,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
        "tie_word_embeddings": False,
        "use_sliding_window": False,
        "qkv_bias": True,
        "bos_token_id": BOS_TOKEN_ID,
        "eos_token_id": EOS_TOKEN_ID,
        "pad_token_id": None,
        "dtype": "float32",
    }
    return transformers.Qwen2MoeConfig(**{**fields, **overrides})


def build(path: Path, **overrides: Any) -> Path:
    """Write the tiny random Qwen2-MoE and the test tokenizer into ``path``."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    model = transformers.Qwen2MoeForCausalLM(config(**overrides))
    randomize(model, seed=5005)
    model.save_pretrained(path)
    write_tokenizer(path, qwen2_style=True)
    return path
