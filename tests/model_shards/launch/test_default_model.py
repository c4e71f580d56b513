"""The built-in default model: deterministic, loadable by transformers, written once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from model_shards.launch.default_model import (
    BOS_TOKEN_ID,
    DEFAULT_MODEL_DIR_NAME,
    DEFAULT_VOCAB_SIZE,
    EOS_TOKEN_ID,
    MODEL_FILES,
    build_tokenizer,
    default_cache_dir,
    ensure_default_model,
    write_default_model,
)

MIXED_TEXTS = [
    "Hello, world! The server answers the request.",
    "你好，世界。日本語のテキスト、한국어 텍스트",
    "emoji 🤗🚀👩‍👩‍👧 and accents: naïve café — «quotes»",
    "  leading spaces, tabs\tand\nnewlines\r\n trailing  ",
    "def f(x):\n    return x ** 2  # 42%",
    "",
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("default") / "model"
    write_default_model(path)
    return path


def test_tokenizer_training_is_deterministic() -> None:
    assert build_tokenizer().to_str() == build_tokenizer().to_str()
    assert build_tokenizer(960).get_vocab_size() == 960


def test_tokenizer_is_deterministic_across_processes() -> None:
    code = (
        "from model_shards.launch.default_model import build_tokenizer; "
        "print(build_tokenizer().to_str())"
    )
    env_variants = [
        {"RAYON_NUM_THREADS": "1"},
        {"TOKENIZERS_PARALLELISM": "false", "PYTHONHASHSEED": "7"},
    ]
    outputs = set()
    for extra in env_variants:
        env = dict(os.environ, **extra)
        result = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        )
        outputs.add(result.stdout)
    outputs.add(build_tokenizer().to_str() + "\n")
    assert len(outputs) == 1


def test_tokenizer_contract() -> None:
    tok = build_tokenizer()
    assert tok.get_vocab_size() == DEFAULT_VOCAB_SIZE
    assert tok.token_to_id("<s>") == BOS_TOKEN_ID
    assert tok.token_to_id("</s>") == EOS_TOKEN_ID
    for text in MIXED_TEXTS:
        enc = tok.encode(text)
        assert enc.ids[0] == BOS_TOKEN_ID
        assert tok.encode(text, add_special_tokens=False).ids == enc.ids[1:]
        assert tok.decode(enc.ids) == text
    with pytest.raises(ValueError, match="vocab_size"):
        build_tokenizer(10)


def test_write_is_byte_identical(tmp_path: Path, model_dir: Path) -> None:
    other = tmp_path / "again"
    write_default_model(other)
    names = sorted(p.name for p in model_dir.iterdir())
    assert names == sorted(MODEL_FILES)
    assert sorted(p.name for p in other.iterdir()) == names
    for name in names:
        assert (model_dir / name).read_bytes() == (other / name).read_bytes(), name


def test_config_shape(model_dir: Path) -> None:
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["vocab_size"] == build_tokenizer().get_vocab_size()
    for tp in (1, 2, 4):
        assert config["intermediate_size"] % tp == 0
        assert config["num_attention_heads"] % tp == 0
        assert config["num_key_value_heads"] % tp == 0
    assert config["num_key_value_heads"] < config["num_attention_heads"]  # GQA
    assert (config["bos_token_id"], config["eos_token_id"]) == (BOS_TOKEN_ID, EOS_TOKEN_ID)


def test_transformers_loads_model(model_dir: Path) -> None:
    transformers = pytest.importorskip("transformers")
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, output_loading_info=True, attn_implementation="eager"
    )
    assert not info["missing_keys"]
    assert not info["unexpected_keys"]
    assert not info["mismatched_keys"]
    assert model.dtype == torch.float32
    ids = torch.tensor([build_tokenizer().encode(MIXED_TEXTS[0]).ids])
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], DEFAULT_VOCAB_SIZE)
    assert torch.isfinite(logits).all()


def test_transformers_tokenizer_matches_raw(model_dir: Path) -> None:
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(model_dir)
    raw = build_tokenizer()
    assert (hf.bos_token_id, hf.eos_token_id) == (BOS_TOKEN_ID, EOS_TOKEN_ID)
    for text in MIXED_TEXTS:
        ids = hf(text)["input_ids"]
        assert ids == raw.encode(text).ids, text
        assert hf.decode(ids, skip_special_tokens=True) == text


def test_ensure_default_model_is_idempotent(tmp_path: Path) -> None:
    path = ensure_default_model(tmp_path)
    assert path == tmp_path / DEFAULT_MODEL_DIR_NAME
    stamps = {name: (path / name).stat().st_mtime_ns for name in MODEL_FILES}
    inode = path.stat().st_ino
    assert ensure_default_model(tmp_path) == path
    assert {name: (path / name).stat().st_mtime_ns for name in MODEL_FILES} == stamps
    assert path.stat().st_ino == inode
    assert [p.name for p in tmp_path.iterdir()] == [DEFAULT_MODEL_DIR_NAME]  # no temp dirs left


def test_ensure_default_model_replaces_incomplete_dir(tmp_path: Path) -> None:
    broken = tmp_path / DEFAULT_MODEL_DIR_NAME
    broken.mkdir()
    (broken / "config.json").write_text("{}")
    path = ensure_default_model(tmp_path)
    assert sorted(p.name for p in path.iterdir()) == sorted(MODEL_FILES)
    assert json.loads((path / "config.json").read_text())["model_type"] == "llama"
    assert [p.name for p in tmp_path.iterdir()] == [DEFAULT_MODEL_DIR_NAME]


def test_cache_dir_resolution(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SHARDSERVE_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "xdg" / "shardserve"
    monkeypatch.setenv("SHARDSERVE_CACHE_DIR", str(tmp_path / "explicit"))
    assert default_cache_dir() == tmp_path / "explicit"
    assert ensure_default_model() == tmp_path / "explicit" / DEFAULT_MODEL_DIR_NAME
    monkeypatch.delenv("SHARDSERVE_CACHE_DIR")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_cache_dir() == tmp_path / "home" / ".cache" / "shardserve"


def test_concurrent_ensure_gives_one_complete_model(tmp_path: Path, model_dir: Path) -> None:
    code = (
        "import sys; from pathlib import Path; "
        "from model_shards.launch.default_model import ensure_default_model; "
        "print(ensure_default_model(Path(sys.argv[1])))"
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True
        )
        for _ in range(3)
    ]
    outs = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert set(outs) == {str(tmp_path / DEFAULT_MODEL_DIR_NAME)}
    assert [p.name for p in tmp_path.iterdir()] == [DEFAULT_MODEL_DIR_NAME]
    for name in MODEL_FILES:
        written = (tmp_path / DEFAULT_MODEL_DIR_NAME / name).read_bytes()
        assert written == (model_dir / name).read_bytes(), name
