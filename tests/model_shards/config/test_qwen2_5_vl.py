"""Qwen2.5-VL's ``config.json`` (model_shards/config/qwen2_5_vl.py) and the ranks' M-RoPE
positions (model_shards/models/qwen2_5_vl/positions.py): transformers 4.x and 5.x
spellings read alike, unsupported configs refused naming the field, and a chunk's
positions (mid-prompt, past the prompt) as the whole prompt's."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from model_shards.config.model import ModelConfig
from model_shards.config.qwen2_5_vl import qwen_vl_config
from model_shards.config.vlm import is_vlm
from model_shards.messages import MediaInput, NewSequence, SamplingParams, SeqChunk
from model_shards.models.qwen2_5_vl.model import Qwen2_5_VLForConditionalGeneration
from model_shards.models.qwen2_5_vl.positions import MRopePositions
from model_shards.models.qwen2_5_vl.rope import IMAGE, TEXT, VIDEO, mrope_positions

TEXT_CONFIG: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 1001,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": True,
    "use_sliding_window": False,
}
VISION_CONFIG = {"depth": 2, "hidden_size": 32, "num_heads": 4, "intermediate_size": 64}
VISION_CONFIG |= {"out_hidden_size": 64, "window_size": 56, "tokens_per_second": 2}


def _v5(**vision: Any) -> dict[str, Any]:
    """As transformers 5.x writes it: the language model under ``text_config``."""
    rope = {"rope_type": "default", "rope_theta": 5000.0, "mrope_section": [2, 3, 3]}
    return {
        "architectures": ["Qwen2_5_VLForConditionalGeneration"],
        "text_config": {**TEXT_CONFIG, "rope_parameters": rope},
        "vision_config": {**VISION_CONFIG, **vision},
        "image_token_id": 962,
        "video_token_id": 963,
    }


def _v4() -> dict[str, Any]:
    """As transformers 4.x wrote it: text fields at the top, ``rope_scaling`` type mrope."""
    rope = {"type": "mrope", "mrope_section": [2, 3, 3]}
    return {
        "architectures": ["Qwen2_5_VLForConditionalGeneration"],
        **TEXT_CONFIG,
        "rope_theta": 5000.0,
        "rope_scaling": rope,
        "vision_config": VISION_CONFIG,
        "image_token_id": 962,
        "video_token_id": 963,
    }


def test_both_spellings_read_the_same() -> None:
    new, old = ModelConfig.from_dict(_v5()), ModelConfig.from_dict(_v4())
    assert new == old and is_vlm(_v5())
    assert new.head_dim == 16 and new.rope.theta == 5000.0 and new.rope.rope_type == "default"
    assert new.attention_bias and new.tie_word_embeddings and new.vocab_size == 1001
    vl = qwen_vl_config(new.extra, new.head_dim)
    assert vl == qwen_vl_config(old.extra, old.head_dim)
    assert vl.mrope_section == (2, 3, 3) and vl.tokens_per_second == 2.0
    assert vl.num_tokens((2, 4, 6)) == 12 and vl.image_token_id == 962
    Qwen2_5_VLForConditionalGeneration.check_config(new, 256)


def test_refuses_unsupported_configs() -> None:
    with pytest.raises(ValueError, match="vision tower's 6 attention heads are not divisible by 4"):
        ModelConfig.from_dict(_v5(num_heads=6, hidden_size=36)).check_layout(4, 1)
    ModelConfig.from_dict(_v5(num_heads=6, hidden_size=36)).check_layout(2, 1)
    with pytest.raises(ValueError, match="intermediate_size 66 is not divisible by 4"):
        ModelConfig.from_dict(_v5(intermediate_size=66)).check_layout(4, 1)
    bad = _v5()
    bad["text_config"]["rope_parameters"]["mrope_section"] = [2, 3, 4]
    with pytest.raises(ValueError, match="mrope_section"):
        Qwen2_5_VLForConditionalGeneration.check_config(ModelConfig.from_dict(bad), 256)
    yarn = copy.deepcopy(_v5())
    yarn["text_config"]["rope_parameters"] = {"rope_type": "yarn", "factor": 2.0}
    with pytest.raises(ValueError, match="rope type 'yarn'"):
        ModelConfig.from_dict(yarn)
    with pytest.raises(ValueError, match="out_hidden_size"):
        Qwen2_5_VLForConditionalGeneration.check_config(
            ModelConfig.from_dict(_v5(out_hidden_size=32)), 256
        )
    window = copy.deepcopy(_v5())
    window["text_config"]["use_sliding_window"] = True
    with pytest.raises(ValueError, match="use_sliding_window"):
        Qwen2_5_VLForConditionalGeneration.check_config(ModelConfig.from_dict(window), 256)


def _item(offset: int, grid: list[int], kind: str, seconds: float = 0.0) -> MediaInput:
    length = grid[0] * grid[1] * grid[2] // 4
    return MediaInput(
        offset, length, b"h", b"", [], kind=kind, grid_thw=grid, second_per_grid=seconds
    )


def test_chunk_positions_are_the_prompts() -> None:
    """From the media metadata alone: equal to the token-type port of get_rope_index
    (tests/model_shards/models/qwen2_5_vl/test_rope.py) for the whole prompt, for any chunk of
    it, and
    ``p + delta`` past it; text-only sequences plain, a text-only step no rows."""
    types = [TEXT] * 3 + [IMAGE] * 6 + [TEXT] * 2 + [VIDEO] * 8 + [TEXT] * 4
    want, delta = mrope_positions(types, [(1, 4, 6)], [(2, 4, 4)], 2, 2.0, [1.5])
    media = [_item(3, [1, 4, 6], "image"), _item(11, [2, 4, 4], "video", 1.5)]
    state = MRopePositions(torch.ones(8), [2, 3, 3], 2, 2.0, torch.device("cpu"))
    state.add(NewSequence(7, SamplingParams(), len(types), media=media))
    state.add(NewSequence(8, SamplingParams(), 5))  # text only
    assert state.rotary_rows([SeqChunk(8, 0, [1] * 5)]) is None
    n = len(types)
    chunks = [SeqChunk(7, 5, [1] * 9), SeqChunk(8, 2, [1] * 3), SeqChunk(7, n - 2, [1] * 4)]
    got = state.positions(chunks)
    assert got is not None
    past = torch.arange(n, n + 2).expand(3, -1) + delta
    expected = [want[:, 5:14], torch.arange(2, 5).expand(3, -1), want[:, n - 2 :], past]
    assert torch.equal(got, torch.cat(expected, dim=1))
    assert delta < 0  # the media runs take fewer positions than tokens


def test_rotary_rows_split_frequencies_by_stream() -> None:
    """Frequency k turns with stream 0 for k < 2, 1 for k < 5, 2 after (HF's sections)."""
    inv = torch.tensor([1.0, 0.5, 0.25, 0.125, 0.1, 0.05, 0.02, 0.01])
    state = MRopePositions(inv, [2, 3, 3], 2, 1.0, torch.device("cpu"))
    state.add(NewSequence(1, SamplingParams(), 6, media=[_item(1, [1, 4, 4], "image")]))
    rows = state.rotary_rows([SeqChunk(1, 0, [1] * 6)])
    pos = state.positions([SeqChunk(1, 0, [1] * 6)])
    assert rows is not None and pos is not None
    cos, _ = rows
    stream = torch.tensor([0, 0, 1, 1, 1, 2, 2, 2])
    angles = pos[stream].t().float() * inv  # [T, 8]
    assert torch.allclose(cos, torch.cat([angles.cos(), angles.cos()], dim=1))
