"""The tiny parity checkpoints build, load in transformers and decode non-trivially."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from safetensors import safe_open
from tokenizers import Tokenizer

from model_shards.config.model import ModelConfig
from tests.checkpoints import (
    LLAMA3_ROPE,
    LLAMA_ROPE_THETA,
    LLAMA_VOCAB_SIZE,
    QWEN2_VOCAB_SIZE,
    TOKENIZER_VOCAB_SIZE,
    build_tiny_llama,
    build_tiny_qwen2,
    hf_greedy,
    hf_prompt_logits,
    load_hf_model,
)

PROMPT_TEXT = "The server answers the request"
TRICKY_TEXTS = (
    PROMPT_TEXT,
    "12345 I'M here, it's 3.14",
    "cafe\u0301 naïve — 你好，世界 🤗🚀",
    "a   b\n\n\tc  ",
)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_qwen2(tmp_path_factory.mktemp("qwen2"))


def _tensor_names(model_dir: Path) -> set[str]:
    names: set[str] = set()
    for file in model_dir.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as f:
            names.update(f.keys())
    return names


def test_llama_is_sharded_with_index(llama_dir: Path) -> None:
    index = json.loads((llama_dir / "model.safetensors.index.json").read_text())
    files = set(index["weight_map"].values())
    assert len(files) >= 2
    assert files == {p.name for p in llama_dir.glob("*.safetensors")}
    assert set(index["weight_map"]) == _tensor_names(llama_dir)
    assert "lm_head.weight" in index["weight_map"]  # untied


def test_llama_unsharded(tmp_path: Path) -> None:
    path = build_tiny_llama(tmp_path, sharded=False)
    assert [p.name for p in path.glob("*.safetensors")] == ["model.safetensors"]
    assert not (path / "model.safetensors.index.json").exists()


def test_qwen2_single_file_tied_with_bias(qwen2_dir: Path) -> None:
    assert [p.name for p in qwen2_dir.glob("*.safetensors")] == ["model.safetensors"]
    names = _tensor_names(qwen2_dir)
    assert "lm_head.weight" not in names  # tied to the embedding
    with safe_open(str(qwen2_dir / "model.safetensors"), framework="pt") as f:
        for proj in ("q_proj", "k_proj", "v_proj"):
            bias = f.get_tensor(f"model.layers.0.self_attn.{proj}.bias")
            assert bias.abs().min() > 0
        assert f.get_tensor("model.layers.5.mlp.down_proj.weight").dtype == torch.float32


def test_llama3_rope_survives_config_round_trip(llama_dir: Path) -> None:
    raw = json.loads((llama_dir / "config.json").read_text())
    rope = raw.get("rope_parameters") or raw.get("rope_scaling")
    assert rope is not None
    for key, value in LLAMA3_ROPE.items():
        assert rope[key] == value, key
    assert rope.get("rope_theta", raw.get("rope_theta")) == LLAMA_ROPE_THETA
    reloaded = transformers.AutoConfig.from_pretrained(llama_dir)
    assert reloaded.rope_parameters["rope_type"] == "llama3"
    ours = ModelConfig.from_dir(llama_dir)
    assert ours.rope.rope_type == "llama3"
    assert ours.rope.theta == LLAMA_ROPE_THETA
    assert ours.rope.factor == LLAMA3_ROPE["factor"]
    assert ours.rope.original_max_position_embeddings == 64


@pytest.mark.parametrize(
    ("builder", "vocab", "layers", "tied"),
    [(build_tiny_llama, LLAMA_VOCAB_SIZE, 4, False), (build_tiny_qwen2, QWEN2_VOCAB_SIZE, 6, True)],
)
def test_our_config_reads_shapes(
    tmp_path: Path, builder: Callable[[Path], Path], vocab: int, layers: int, tied: bool
) -> None:
    cfg = ModelConfig.from_dir(builder(tmp_path))
    assert (cfg.vocab_size, cfg.num_layers, cfg.tie_word_embeddings) == (vocab, layers, tied)
    assert (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (64, 4, 2, 16)
    assert cfg.intermediate_size == 128
    cfg.check_layout(tp=4, pp=4)


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_loads_in_transformers_and_decodes(name: str, llama_dir: Path, qwen2_dir: Path) -> None:
    path = llama_dir if name == "llama" else qwen2_dir
    loaded: Any = transformers.AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    info = loaded[1]
    assert not info["missing_keys"] and not info["unexpected_keys"]

    tok = transformers.AutoTokenizer.from_pretrained(path)
    assert len(tok) == TOKENIZER_VOCAB_SIZE
    raw = Tokenizer.from_file(str(path / "tokenizer.json"))  # what shardserve loads
    assert raw.get_vocab_size() == TOKENIZER_VOCAB_SIZE
    for text in TRICKY_TEXTS:
        ids = tok(text)["input_ids"]
        assert ids == raw.encode(text).ids, text
        assert tok.decode(ids, skip_special_tokens=True) == raw.decode(ids)
    prompt = tok(PROMPT_TEXT)["input_ids"]

    logits = hf_prompt_logits(path, prompt)
    vocab = LLAMA_VOCAB_SIZE if name == "llama" else QWEN2_VOCAB_SIZE
    assert logits.shape == (len(prompt), vocab)
    assert logits.dtype == torch.float32
    assert logits.std(dim=-1).min() > 0.5  # not all near zero

    new = hf_greedy(path, prompt, 24)
    assert len(new) == 24
    assert len(set(new)) > 4  # not one token repeated
    assert new[0] == int(logits[-1].argmax())


def test_hf_greedy_matches_generate(llama_dir: Path) -> None:
    model: Any = load_hf_model(llama_dir)
    prompt = [0, 17, 230, 5, 901]
    ids = torch.tensor([prompt])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=8,
        min_new_tokens=8,
        eos_token_id=None,
        pad_token_id=1,
    )
    assert out[0, len(prompt) :].tolist() == hf_greedy(llama_dir, prompt, 8)


def test_builds_are_deterministic(tmp_path: Path, llama_dir: Path, qwen2_dir: Path) -> None:
    for builder, reference in ((build_tiny_llama, llama_dir), (build_tiny_qwen2, qwen2_dir)):
        again = builder(tmp_path / reference.name)
        for file in sorted(reference.iterdir()):
            assert file.read_bytes() == (again / file.name).read_bytes(), file.name
