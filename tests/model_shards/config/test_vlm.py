"""A LLaVA ``config.json`` read without torch: the language model's fields from
``text_config`` (transformers' defaults where absent), the tower's shape and placeholders
per image, the layouts the tower can take and the fields refused, each named."""

from __future__ import annotations

from typing import Any

import pytest

from model_shards.config.model import ModelConfig
from model_shards.config.vlm import llava_config

TEXT = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 100,
}
VISION = {
    "hidden_size": 48,
    "intermediate_size": 96,
    "num_hidden_layers": 3,
    "num_attention_heads": 6,
    "image_size": 28,
    "patch_size": 14,
}


def _raw(**top: Any) -> dict[str, Any]:
    vision = {**VISION, **top.pop("vision", {})}
    return {
        "architectures": ["LlavaForConditionalGeneration"],
        "text_config": TEXT,
        "vision_config": vision,
        "image_token_index": 99,
        **top,
    }


def test_text_fields_come_from_text_config() -> None:
    cfg = ModelConfig.from_dict(_raw())
    assert (cfg.hidden_size, cfg.num_layers, cfg.vocab_size) == (64, 2, 100)
    assert cfg.rms_norm_eps == 1e-6  # LlamaConfig's default, text_config left it out


def test_placeholders_per_image_follow_the_select_strategy() -> None:
    assert llava_config(_raw()).tokens_per_image == 4  # (28 / 14)^2, CLS dropped
    full = llava_config(_raw(vision_feature_select_strategy="full"))
    assert full.tokens_per_image == 5
    assert llava_config(_raw(vision_feature_layer=[-1, 1])).feature_layers == (3, 1)


def test_the_tower_must_split_over_tp() -> None:
    cfg = ModelConfig.from_dict(_raw())
    assert cfg.valid_tp_sizes() == [1, 2]  # 6 vision heads: not 4
    with pytest.raises(ValueError, match="vision tower's 6 attention heads"):
        cfg.check_layout(4, 1)


@pytest.mark.parametrize(
    ("top", "field"),
    [
        ({"vision_feature_layer": 7}, "vision_feature_layer"),
        ({"vision_feature_select_strategy": "patch"}, "vision_feature_select_strategy"),
        ({"projector_hidden_act": "relu6"}, "projector_hidden_act"),
        ({"vision": {"hidden_act": "swish"}}, "vision_config.hidden_act"),
        ({"vision": {"model_type": "siglip_vision_model"}}, "vision_config.model_type"),
    ],
)
def test_unsupported_fields_are_named(top: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        llava_config(_raw(**top))
