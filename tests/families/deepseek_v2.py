"""Tiny random DeepSeek-V2 (``DeepseekV2ForCausalLM``): multi-head latent attention, 8
experts in 4 groups (group-limited top-2), a shared expert, one dense first layer.

=============  ====================================================================
hidden         72, 4 heads; q: q_lora_rank 40 (q_a_proj, q_a_layernorm, q_b_proj)
MLA            kv_lora_rank 36, qk_rope_head_dim 8 (interleaved RoPE), qk_nope_head_dim
               14, v_head_dim 18: the KV cache holds 36 + 8 = 44 values per token per
               layer, not 2 x 4 x 22
experts        8 per sparse layer of intermediate 26 (tp=2: 13 per rank; expert
               parallel: 4 whole experts per rank), top 2 within the best 2 of 4 groups,
               weights x 1.5 (routed_scaling_factor), 1 shared expert
layers         3; layer 0 dense (first_k_dense_replace 1, intermediate 100)
rope           YaRN: factor 4 over an original 64 positions, mscale = mscale_all_dim 0.707
vocab          503 (prime)
lm_head        untied
=============  ====================================================================

Weights redrawn as in ``tests/checkpoints.py``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import transformers

from model_shards.launch.default_model import BOS_TOKEN_ID, EOS_TOKEN_ID
from tests.checkpoints import randomize, write_tokenizer

NAME = "deepseek_v2"
VOCAB_SIZE = 503
MAX_POSITIONS = 256
NUM_EXPERTS = 8
KV_LORA_RANK, QK_ROPE_HEAD_DIM = 36, 8
LAYOUTS = [(1, 1), (2, 1), (1, 2)]  # tp=2 with expert parallelism: test_moe_parity.py


def config(**overrides: Any) -> transformers.DeepseekV2Config:
    """The tiny DeepSeek-V2 of the module table; ``overrides`` replace any field."""
    fields: dict[str, Any] = {
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 72,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "q_lora_rank": 40,
        "kv_lora_rank": KV_LORA_RANK,
        "qk_rope_head_dim": QK_ROPE_HEAD_DIM,
        "qk_nope_head_dim": 14,
        "v_head_dim": 18,
        "intermediate_size": 100,
        "moe_intermediate_size": 26,
        "n_routed_experts": NUM_EXPERTS,
        "num_experts_per_tok": 2,
        "n_shared_experts": 1,
        "topk_method": "group_limited_greedy",
        "n_group": 4,
        "topk_group": 2,
        "routed_scaling_factor": 1.5,
        "first_k_dense_replace": 1,
        "num_hidden_layers": 3,
        "max_position_embeddings": MAX_POSITIONS,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {  # DeepSeek-V2's YaRN, at a tiny original length
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 64,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 0.707,
            "mscale_all_dim": 0.707,
        },
        "tie_word_embeddings": False,
        "attention_bias": False,
        "bos_token_id": BOS_TOKEN_ID,
        "eos_token_id": EOS_TOKEN_ID,
        "pad_token_id": None,
        "dtype": "float32",
    }
    return transformers.DeepseekV2Config(**{**fields, **overrides})


def build(path: Path, **overrides: Any) -> Path:
    """Write the tiny random DeepSeek-V2 and the test tokenizer into ``path``."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    model = transformers.DeepseekV2ForCausalLM(config(**overrides))
    randomize(model, seed=7007)
    model.save_pretrained(path)
    write_tokenizer(path, qwen2_style=False)
    return path
