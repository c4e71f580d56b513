"""The served decoder architectures are listed once (model_shards/config/architectures.py): the
registry builds a class for exactly those, and config validation accepts exactly those."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from model_shards.config.architectures import DECODER_FAMILIES, SUPPORTED_ARCHITECTURES
from model_shards.config.model import ModelConfig
from model_shards.models import MODEL_REGISTRY
from model_shards.models.llama import LlamaForCausalLM


def test_registry_covers_exactly_the_supported_architectures() -> None:
    assert tuple(MODEL_REGISTRY) == SUPPORTED_ARCHITECTURES == tuple(DECODER_FAMILIES)
    for arch, family in DECODER_FAMILIES.items():  # each name's class lives in its family's
        cls = MODEL_REGISTRY[arch]  # file, or in its folder's model.py
        home = {f"model_shards.models.{family}", f"model_shards.models.{family}.model"}
        assert cls.__module__ in home, (arch, cls)
    assert MODEL_REGISTRY["LlamaForCausalLM"] is LlamaForCausalLM
    with pytest.raises(TypeError):
        MODEL_REGISTRY["SomeOtherForCausalLM"] = LlamaForCausalLM  # type: ignore[index]


def _config_dir(path: Path, architecture: str) -> Path:
    path.mkdir()
    config = {
        "architectures": [architecture],
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 100,
        "max_position_embeddings": 128,
        "rms_norm_eps": 1e-6,
    }
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.mark.parametrize("architecture", SUPPORTED_ARCHITECTURES)
def test_config_accepts_each_supported_architecture(tmp_path: Path, architecture: str) -> None:
    cfg = ModelConfig.from_dir(_config_dir(tmp_path / "m", architecture))
    assert cfg.architecture == architecture and cfg.architecture in MODEL_REGISTRY


def test_config_refuses_an_unlisted_architecture(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"GPTNeoXForCausalLM.*not supported"):
        ModelConfig.from_dir(_config_dir(tmp_path / "m", "GPTNeoXForCausalLM"))
