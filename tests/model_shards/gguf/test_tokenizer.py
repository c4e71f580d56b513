"""Tokenizers built from GGUF metadata: the ids and text of transformers' GGUF tokenizer
(``AutoTokenizer.from_pretrained(dir, gguf_file=name)``) and of llama.cpp, on the real
SmolLM2 file and on small byte-level and SentencePiece vocabularies written here."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from model_shards.gguf.tokenizer import build_tokenizer
from server.text.chat_template import ChatTemplate
from server.text.tokenizer import Tokenizer
from tests.server.conftest import write_tiny_tokenizer
from tests.server.text.gguf_vocab_files import (
    byte_level_vocab,
    sentencepiece_vocab,
    smollm2_gguf,
    write_vocab_gguf,
)

TEXTS = [
    "Hello world! 123",
    "héllo wörld 你好，世界 😀🎉🚀 Ωmega ∑",
    "  leading, double  and   triple spaces ",
    "x  \n\n  y\t\tz 3.14159 1000000",
    "I'LL don't we've",
    "one <|im_start|> two </s> <s>three <think>x<|im_end|>",
    "",
    " ",
]


def _reference(path: Path) -> Any:
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def _assert_same(ours: Tokenizer, reference: Any, texts: list[str]) -> None:
    for text in texts:
        ids = ours.encode(text)
        assert ids == reference(text)["input_ids"], text
        assert ours.decode(ids) == reference.decode(ids, skip_special_tokens=True), text


@pytest.fixture(scope="module")
def smollm2() -> Tokenizer:
    return Tokenizer.from_dir(smollm2_gguf())


def test_smollm2_matches_transformers_and_llama_cpp(smollm2: Tokenizer) -> None:
    reference = _reference(smollm2_gguf())
    _assert_same(smollm2, reference, TEXTS)
    # llama.cpp's own expectations for this vocabulary: digits one by one, no BOS
    assert smollm2.encode("Hello world! 123") == [19556, 905, 17, 216, 33, 34, 35]
    assert smollm2.encode("  multiple   spaces") == [216, 2701, 256, 5600]
    assert smollm2.decode(smollm2.encode(TEXTS[1])) == TEXTS[1]
    assert (smollm2.bos_token, smollm2.eos_token) == ("<|im_start|>", "<|im_end|>")
    assert (smollm2.eos_token_id, smollm2.vocab_size) == (2, 49152)


def test_smollm2_chat_template_renders_as_transformers(smollm2: Tokenizer) -> None:
    reference = _reference(smollm2_gguf())
    assert smollm2.chat_template == reference.chat_template
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    text = ChatTemplate(smollm2.chat_template, smollm2.special_tokens).render(
        messages, add_generation_prompt=True
    )
    assert text == reference.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    assert text.endswith(
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    )
    expected = reference.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    assert smollm2.encode(text, add_special_tokens=False) == list(expected["input_ids"])


@pytest.mark.parametrize(
    ("pre", "add_bos"), [("llama-bpe", True), ("qwen2", False), ("gpt-2", False)]
)
def test_byte_level_vocabularies_match_transformers(
    tmp_path: Path, pre: str, add_bos: bool
) -> None:
    path = write_vocab_gguf(tmp_path / "vocab.gguf", byte_level_vocab(pre, add_bos))
    ours = Tokenizer.from_dir(tmp_path)  # the directory holding one GGUF
    _assert_same(ours, _reference(path), TEXTS)
    assert (ours.encode("hi")[0] == 0) is add_bos
    assert ours.encode("<|im_start|>", add_special_tokens=False) == [1]  # never split
    think = ours.encode("<think>", add_special_tokens=False)
    assert len(think) == 1 and ours.decode(think) == "<think>"  # user-defined: not special


def test_smollm_split_isolates_digits_as_llama_cpp(tmp_path: Path) -> None:
    """``smollm`` splits digits one by one before GPT-2's regex (llama.cpp, and SmolLM's
    tokenizer.json); transformers' GGUF reader skips that split, so its ids differ here."""
    vocab = byte_level_vocab("smollm", False)
    tokens = vocab["tokenizer.ggml.tokens"]
    ours = Tokenizer.from_dir(write_vocab_gguf(tmp_path / "smol.gguf", vocab))
    assert [tokens[i] for i in ours.encode(" 123x")] == ["Ġ", "1", "2", "3", "x"]


def _gemma_vocab() -> dict[str, Any]:
    """Gemma's shape: no space prefix, runs of spaces stored as spaces (looked up as ▁▁)."""
    vocab = sentencepiece_vocab() | {"tokenizer.ggml.add_space_prefix": False}
    for key, extra in (("tokens", ["  ", "   "]), ("scores", [-1e4] * 2), ("token_type", [1] * 2)):
        vocab[f"tokenizer.ggml.{key}"] = vocab[f"tokenizer.ggml.{key}"] + extra
    return vocab


@pytest.mark.parametrize("arch", ["llama", "phi3", "gemma2"])
def test_sentencepiece_vocabulary_matches_transformers(tmp_path: Path, arch: str) -> None:
    vocab = _gemma_vocab() if arch == "gemma2" else sentencepiece_vocab()
    path = write_vocab_gguf(tmp_path / "spm.gguf", vocab, arch)
    ours = Tokenizer.from_dir(path)
    _assert_same(ours, _reference(path), TEXTS)
    ids = ours.encode("héllo 😀")
    assert ids[0] == 1  # BOS by default for a SentencePiece vocabulary
    assert any(3 <= i < 259 for i in ids)  # the emoji falls back to byte tokens
    assert ours.decode(ids) == "héllo 😀"


def test_add_space_prefix_false_puts_no_space(tmp_path: Path) -> None:
    vocab = sentencepiece_vocab() | {"tokenizer.ggml.add_space_prefix": False}
    tokens = vocab["tokenizer.ggml.tokens"]
    ours = Tokenizer.from_dir(write_vocab_gguf(tmp_path / "spm.gguf", vocab))
    assert not tokens[ours.encode("Hello", add_special_tokens=False)[0]].startswith("▁")
    with_prefix = Tokenizer(*build_tokenizer(sentencepiece_vocab()))
    assert tokens[with_prefix.encode("Hello", add_special_tokens=False)[0]].startswith("▁")


def test_named_chat_templates_keep_default_first() -> None:
    metadata = byte_level_vocab("gpt-2", False) | {"tokenizer.chat_template.tool_use": "T"}
    ours = Tokenizer(*build_tokenizer(metadata))
    assert ours.chat_template == metadata["tokenizer.chat_template"]


def test_sibling_tokenizer_json_wins(tmp_path: Path) -> None:
    write_vocab_gguf(tmp_path / "m.gguf", byte_level_vocab("gpt-2", False))
    write_tiny_tokenizer(tmp_path)  # a tokenizer.json beside the GGUF: <s>=0 as BOS
    assert Tokenizer.from_dir(tmp_path / "m.gguf").bos_token == "<s>"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"tokenizer.ggml.model": "bert"}, r"tokenizer\.ggml\.model 'bert' is not supported"),
        ({"tokenizer.ggml.pre": "nonesuch"}, r"tokenizer\.ggml\.pre 'nonesuch' is not supported"),
        ({"tokenizer.ggml.eos_token_id": 10**6}, r"eos_token_id = 1000000 is outside"),
        ({"tokenizer.ggml.merges": ["nospace"]}, r"holds 'nospace', not two pieces"),
        ({"tokenizer.ggml.merges": ["q@ #z"]}, r"merges do not fit the vocabulary"),
        ({"tokenizer.ggml.tokens": [1, 2, 3]}, r"tokenizer\.ggml\.tokens is not a list of str"),
    ],
)
def test_bad_metadata_is_a_value_error(change: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build_tokenizer(byte_level_vocab("gpt-2", False) | change)


def test_no_tokenizer_anywhere_is_a_value_error(tmp_path: Path) -> None:
    vocab = byte_level_vocab("gpt-2", True)
    del vocab["tokenizer.ggml.bos_token_id"]
    with pytest.raises(ValueError, match=r"add_bos_token is true but tokenizer\.ggml\.bos"):
        build_tokenizer(vocab)
    with pytest.raises(ValueError, match="no tokenizer in the GGUF metadata"):
        build_tokenizer({"general.architecture": "llama"})
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf at all")
    with pytest.raises(ValueError, match="not a GGUF file"):
        Tokenizer.from_dir(tmp_path)
    shutil.rmtree(tmp_path)
    tmp_path.mkdir()
    with pytest.raises(ValueError, match=r"--tokenizer .*: no tokenizer\.json .*and no GGUF"):
        Tokenizer.from_dir(tmp_path, flag="--tokenizer")
