"""YaRN rotary tables (DeepSeek-V2's long-context RoPE, also Qwen's and Llama's) against
transformers' ``yarn`` initialisation: frequencies, and cos/sin scaled by its attention
factor, with and without DeepSeek's ``mscale``/``mscale_all_dim``."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from model_shards.config.rope import parse_rope, yarn_mscale
from model_shards.layers.rotary import RotaryEmbedding

CASES: list[dict[str, Any]] = [
    {"factor": 4.0, "original_max_position_embeddings": 64},
    {
        "factor": 40.0,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 0.707,
        "mscale_all_dim": 0.707,
    },
    {
        "factor": 8.0,
        "original_max_position_embeddings": 512,
        "mscale": 1.0,
        "mscale_all_dim": 0.5,
        "truncate": False,
    },
]


@pytest.mark.parametrize("params", CASES, ids=["plain", "deepseek-v2", "untruncated"])
def test_yarn_tables_match_transformers(params: dict[str, Any]) -> None:
    rope = {"rope_type": "yarn", "rope_theta": 10000.0, **params}
    hf = transformers.LlamaConfig(
        hidden_size=256, num_attention_heads=4, max_position_embeddings=8192, rope_parameters=rope
    )
    inv_freq, attention = ROPE_INIT_FUNCTIONS["yarn"](hf, torch.device("cpu"))
    ours = parse_rope(hf.to_dict())
    assert ours.rope_type == "yarn" and ours.attention_factor == pytest.approx(attention)
    table = RotaryEmbedding(64, 300, ours)
    angles = torch.outer(torch.arange(300, dtype=torch.float32), inv_freq)  # [P, 32]
    torch.testing.assert_close(table.cos_cached[:, :32], angles.cos() * attention)
    torch.testing.assert_close(table.sin_cached[:, 32:], angles.sin() * attention)


def test_yarn_mscale() -> None:
    assert yarn_mscale(1.0, 0.707) == 1.0
    assert yarn_mscale(40.0, 0.707) == pytest.approx(0.1 * 0.707 * 3.6888794541139363 + 1)
