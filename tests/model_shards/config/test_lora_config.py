"""The checks of LoRA flags and PEFT adapters (``model_shards/config/lora.py``): each refusal
names the flag or field, before any rank exists."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from model_shards.config.lora import parse_lora_modules, read_adapter
from model_shards.config.model import ModelConfig
from model_shards.config.replica import ReplicaConfig
from tests.raw_adapters import TINY_SHAPES, write_raw_adapter
from tests.server.conftest import write_tiny_model_config


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-model")
    write_tiny_model_config(path, vocab_size=400)
    return path


def test_a_good_adapter_reads_its_rank_scale_and_targets(model_dir: Path, tmp_path: Path) -> None:
    model = ModelConfig.from_dir(model_dir)
    path = write_raw_adapter(tmp_path / "a", ("q_proj", "down_proj"), r=4)
    info = read_adapter("a", str(path), model, max_rank=8)
    assert (info.rank, info.scale, info.target_modules) == (4, 2.0, ("q_proj", "down_proj"))
    rs = write_raw_adapter(tmp_path / "rs", r=4, config={"use_rslora": True, "lora_alpha": 6})
    assert math.isclose(read_adapter("rs", str(rs), model, 8).scale, 3.0)


BAD = [
    ("missing", {}, "no adapter_config.json"),
    ("rank", {"r": 16}, "rank r=16 is above --max-lora-rank 8"),
    ("target", {"targets": ("q_proj", "lm_head")}, "unknown target module(s) ['lm_head']"),
    ("shape", {"shapes": {**TINY_SHAPES, "q_proj": (32, 64)}}, "the base model's q_proj needs"),
    ("layers", {"layers": 3}, "the model has 2 layers"),
    ("peft", {"config": {"peft_type": "IA3"}}, "peft_type 'IA3' is not LORA"),
    ("bias", {"config": {"bias": "all"}}, "'bias' 'all'"),
]


@pytest.mark.parametrize(("case", "options", "words"), BAD, ids=[b[0] for b in BAD])
def test_a_bad_adapter_is_refused_naming_the_flag(
    model_dir: Path, tmp_path: Path, case: str, options: dict, words: str
) -> None:
    path = tmp_path / case
    if case != "missing":
        write_raw_adapter(path, **options)
    replica = ReplicaConfig(
        str(model_dir), device="cpu", enable_lora=True, max_lora_rank=8,
        lora_modules=(f"x={path}",),
    )  # fmt: skip
    with pytest.raises(ValueError, match="--lora-modules x=") as err:
        replica.validate()
    assert words in str(err.value)


@pytest.mark.parametrize(
    ("options", "words"),
    [
        ({"lora_modules": ("a=/x",)}, "--lora-modules needs --enable-lora"),
        ({"enable_lora": True, "lora_modules": ("a",)}, "--lora-modules 'a': expected NAME=PATH"),
        ({"enable_lora": True, "lora_modules": ("a=/x", "a=/y")}, "'a' is given twice"),
        ({"enable_lora": True, "max_loras": 0}, "--max-loras must be >= 1"),
        ({"enable_lora": True, "max_lora_rank": 0}, "--max-lora-rank"),
        ({"enable_lora": True, "max_loras": 4, "max_cpu_loras": 2}, "--max-cpu-loras 2"),
    ],
)
def test_bad_lora_flags_are_refused(model_dir: Path, options: dict, words: str) -> None:
    with pytest.raises(ValueError) as err:
        ReplicaConfig(str(model_dir), device="cpu", **options).validate()
    assert words in str(err.value)


def test_lora_modules_parse_into_name_path_pairs() -> None:
    assert parse_lora_modules(["a=/p/a", "b=/p/b=c"]) == (("a", "/p/a"), ("b", "/p/b=c"))
