"""Tiny random Phi-3 (``Phi3ForCausalLM``): fused ``qkv_proj`` / ``gate_up_proj``
checkpoint tensors, LongRoPE with an attention factor, partial rotary (as Phi-4 mini),
GQA, an untied LM head, and Phi-3's chat template.

=============  ====================================================================
hidden         96, 6 query heads x head_dim 16 (= 96 / 6)
kv heads       2 (GQA; tp=2: one per rank)
intermediate   90 (45 per rank at tp=2)
layers         3 (pp=2 splits 2 + 1)
vocab          967 (prime: tp=2 splits it unevenly; holds the 960-token test tokenizer)
rope           longrope, original max 64 of 256 positions (attention factor
               sqrt(1 + ln 4 / ln 64)), 6 short / 6 long factors
rotary         partial_rotary_factor 0.75: 12 of 16 dims turn
sliding window 262144 (larger than any length: no effect, as Phi-3.5 mini's)
lm_head        untied; no biases
=============  ====================================================================

The parity prompts and their generations stay below 64 tokens, so they use the short
factors everywhere, as transformers does. Weights are redrawn like the other tiny
checkpoints (``tests/checkpoints.py``: matrices ``N(0, 0.2)``, norms ``1 + N(0, 0.1)``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import transformers

from model_shards.launch.default_model import BOS_TOKEN_ID, EOS_TOKEN_ID
from tests.checkpoints import randomize, write_tokenizer

NAME = "phi3"
VOCAB_SIZE = 967
HEAD_DIM = 16
MAX_POSITIONS = 256
ORIGINAL_MAX_POSITIONS = 64
PARTIAL_ROTARY_FACTOR = 0.75

# microsoft/Phi-3-mini-4k-instruct's tokenizer_config.json "chat_template"
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}"
    "{{'<|system|>\\n' + message['content'] + '<|end|>\\n'}}"
    "{% elif message['role'] == 'user' %}"
    "{{'<|user|>\\n' + message['content'] + '<|end|>\\n'}}"
    "{% elif message['role'] == 'assistant' %}"
    "{{'<|assistant|>\\n' + message['content'] + '<|end|>\\n'}}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% else %}{{ eos_token }}{% endif %}"
)


def longrope(partial_rotary_factor: float = PARTIAL_ROTARY_FACTOR) -> dict[str, Any]:
    """``rope_parameters`` with one short and one long factor per frequency of the rotated
    dims (``head_dim * partial_rotary_factor / 2`` of them), all distinct."""
    n = int(HEAD_DIM * partial_rotary_factor) // 2
    return {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "partial_rotary_factor": partial_rotary_factor,
        "original_max_position_embeddings": ORIGINAL_MAX_POSITIONS,
        "short_factor": [1.0 + 0.15 * i for i in range(n)],
        "long_factor": [1.5 + 2.5 * i for i in range(n)],
    }


def config(**overrides: Any) -> transformers.Phi3Config:
    """The tiny Phi-3 of the module table; ``overrides`` replace any field."""
    fields: dict[str, Any] = {
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 6 * HEAD_DIM,
        "num_attention_heads": 6,
        "num_key_value_heads": 2,
        "intermediate_size": 90,
        "num_hidden_layers": 3,
        "max_position_embeddings": MAX_POSITIONS,
        "original_max_position_embeddings": ORIGINAL_MAX_POSITIONS,
        "rms_norm_eps": 1e-5,
        "rope_parameters": longrope(),
        "sliding_window": 262144,
        "tie_word_embeddings": False,
        "initializer_range": 0.2,
        "bos_token_id": BOS_TOKEN_ID,
        "eos_token_id": EOS_TOKEN_ID,
        "pad_token_id": None,
        "dtype": "float32",
    }
    return transformers.Phi3Config(**{**fields, **overrides})


def build(path: Path, **overrides: Any) -> Path:
    """Write the tiny random Phi-3 (one ``model.safetensors``) and its tokenizer into
    ``path``; ``overrides``: config fields (see :func:`config`). Returns ``path``."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    model = transformers.Phi3ForCausalLM(config(**overrides))
    randomize(model, seed=3303)
    model.save_pretrained(path)
    write_tokenizer(path, qwen2_style=False, chat_template=CHAT_TEMPLATE)
    return path
