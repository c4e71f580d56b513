"""Tiny random Mixtral (``MixtralForCausalLM``): 8 experts, top-2, renormalised softmax routing.

=============  ====================================================================
hidden         88, 4 query heads x head_dim 22
kv heads       2 (GQA; tp=2: one per rank)
experts        8 per layer, top 2, each of intermediate 60 (tp=2: 30 per rank; tp=2 with
               expert parallelism: 4 whole experts per rank)
layers         3 (pp=2 splits 2 + 1)
vocab          503 (prime: tp=2 splits it unevenly)
lm_head        untied
=============  ====================================================================

Weights are redrawn like the other tiny checkpoints (``tests/checkpoints.py``: matrices,
router included, ``N(0, 0.2)``; norm weights ``1 + N(0, 0.1)``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import transformers

from model_shards.launch.default_model import BOS_TOKEN_ID, EOS_TOKEN_ID
from tests.checkpoints import randomize, write_tokenizer

NAME = "mixtral"
VOCAB_SIZE = 503
MAX_POSITIONS = 256
NUM_EXPERTS = 8
LAYOUTS = [(1, 1), (2, 1), (1, 2)]  # tp=2 with expert parallelism: test_moe_parity.py


def config(**overrides: Any) -> transformers.MixtralConfig:
    """The tiny Mixtral of the module table; ``overrides`` replace any field."""
    fields: dict[str, Any] = {
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 88,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 60,
        "num_hidden_layers": 3,
        "num_local_experts": NUM_EXPERTS,
        "num_experts_per_tok": 2,
        "max_position_embeddings": MAX_POSITIONS,
        "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
        "tie_word_embeddings": False,
        "sliding_window": None,
        "bos_token_id": BOS_TOKEN_ID,
        "eos_token_id": EOS_TOKEN_ID,
        "pad_token_id": None,
        "dtype": "float32",
    }
    return transformers.MixtralConfig(**{**fields, **overrides})


def build(path: Path, **overrides: Any) -> Path:
    """Write the tiny random Mixtral (one ``model.safetensors``, one tensor per expert
    matrix as Hugging Face saves it) and the test tokenizer into ``path``."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(config(**overrides))
    randomize(model, seed=4004)
    model.save_pretrained(path)
    write_tokenizer(path, qwen2_style=False)
    return path
