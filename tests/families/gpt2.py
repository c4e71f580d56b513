"""Tiny random GPT-2 (``GPT2LMHeadModel``): Conv1D projections (fused ``c_attn``), learned
absolute positions, biased LayerNorms, GELU-tanh MLP, LM head tied to ``wte``.

=============  ====================================================================
hidden         48, 4 heads x head_dim 12 (MHA; tp=2: two heads per rank)
inner          n_inner null -> 4 * 48 = 192 (the real GPT-2's spelling; 96 per rank)
layers         3 (pp=2 splits 2 + 1)
positions      n_positions 160 (> the harness's 128-token max_model_len)
vocab          503 (prime: tp=2 splits it unevenly)
lm_head        tied to wte (no lm_head.weight in the file)
bias           every projection and LayerNorm, non-zero
=============  ====================================================================

Weights: transformers' GPT-2 init with ``initializer_range`` 0.2 (``torch.manual_seed``),
then every bias redrawn ``N(0, 0.1)`` and every LayerNorm weight ``1 + N(0, 0.1)``, so a
bias or norm read from the wrong slice shows in the logits. GPT-2 has no chat template.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import transformers

from model_shards.launch.default_model import BOS_TOKEN_ID, EOS_TOKEN_ID
from tests.checkpoints import BIAS_STD, NORM_STD, write_tokenizer

NAME = "gpt2"
VOCAB_SIZE = 503


def config(**overrides: Any) -> transformers.GPT2Config:
    """The tiny GPT-2 of the module table; ``overrides`` replace any field."""
    fields: dict[str, Any] = {
        "vocab_size": VOCAB_SIZE,
        "n_embd": 48,
        "n_head": 4,
        "n_inner": None,
        "n_layer": 3,
        "n_positions": 160,
        "activation_function": "gelu_new",
        "layer_norm_epsilon": 1e-5,
        "initializer_range": 0.2,
        "bos_token_id": BOS_TOKEN_ID,
        "eos_token_id": EOS_TOKEN_ID,
        "pad_token_id": None,
        "dtype": "float32",
    }
    return transformers.GPT2Config(**{**fields, **overrides})


def _spread_biases_and_norms(model: torch.nn.Module) -> None:
    """Biases ``N(0, BIAS_STD)``, LayerNorm weights ``1 + N(0, NORM_STD)`` (in name order)."""
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if name.endswith(".bias"):
                param.normal_(0.0, BIAS_STD)
            elif ".ln_" in name:
                param.normal_(1.0, NORM_STD)


def build(path: Path, **overrides: Any) -> Path:
    """Write the tiny random GPT-2 (one ``model.safetensors``) and the test tokenizer into
    ``path``; ``overrides``: config fields (see :func:`config`). Returns ``path``."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config(**overrides))
    _spread_biases_and_norms(model)
    model.save_pretrained(path)
    write_tokenizer(path, qwen2_style=False)
    return path
