"""Tiny random Qwen3 (``Qwen3ForCausalLM``): per-head q/k RMSNorm, head_dim independent of
hidden / heads, GQA, tied LM head, and Qwen3's ChatML chat template.

=============  ====================================================================
hidden         96, 4 query heads x head_dim 40 (not 96 / 4 = 24)
kv heads       2 (GQA; tp=2: one per rank)
intermediate   150 (75 per rank at tp=2)
layers         3 (pp=2 splits 2 + 1)
vocab          499 (prime: tp=2 splits it unevenly)
lm_head        tied to embed_tokens
bias           none (attention_bias false, as every released Qwen3)
=============  ====================================================================

Weights are redrawn like the other tiny checkpoints (``tests/checkpoints.py``: matrices
``N(0, 0.2)``, norm weights, ``q_norm``/``k_norm`` included, ``1 + N(0, 0.1)``). The chat
template in ``tokenizer_config.json`` is the one Qwen/Qwen3-8B publishes
(``qwen3_chat_template.jinja``, beside this file).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import transformers

from model_shards.launch.default_model import BOS_TOKEN_ID, EOS_TOKEN_ID
from tests.checkpoints import randomize, write_tokenizer

NAME = "qwen3"
VOCAB_SIZE = 499
MAX_POSITIONS = 256
CHAT_TEMPLATE_FILE = Path(__file__).with_name("qwen3_chat_template.jinja")


def chat_template() -> str:
    """Qwen3's published chat template (the file has one trailing newline the original lacks)."""
    return CHAT_TEMPLATE_FILE.read_text().removesuffix("\n")


def config(**overrides: Any) -> transformers.Qwen3Config:
    """The tiny Qwen3 of the module table; ``overrides`` replace any field."""
    fields: dict[str, Any] = {
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 96,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 40,
        "intermediate_size": 150,
        "num_hidden_layers": 3,
        "max_position_embeddings": MAX_POSITIONS,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
        "tie_word_embeddings": True,
        "attention_bias": False,
        "use_sliding_window": False,
        "initializer_range": 0.2,
        "bos_token_id": BOS_TOKEN_ID,
        "eos_token_id": EOS_TOKEN_ID,
        "pad_token_id": None,
        "dtype": "float32",
    }
    return transformers.Qwen3Config(**{**fields, **overrides})


def build(path: Path, **overrides: Any) -> Path:
    """Write the tiny random Qwen3 (one ``model.safetensors``) and its tokenizer into
    ``path``; ``overrides``: config fields (see :func:`config`). Returns ``path``."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(config(**overrides))
    randomize(model, seed=3003)
    model.save_pretrained(path)
    # transformers loads a qwen3 tokenizer as Qwen2Tokenizer: the Qwen pre-tokenizer
    write_tokenizer(path, qwen2_style=True, chat_template=chat_template())
    return path
