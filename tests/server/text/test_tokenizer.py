"""Tokenizer: same ids as transformers.AutoTokenizer; decode skips specials."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from server.text.tokenizer import Tokenizer
from tests.server.conftest import BOS_ID, EOS_ID, write_tiny_tokenizer

TEXTS = [
    "Hello world!",
    " leading space and  double  spaces",
    "héllo wörld 你好，世界 😀🎉🚀",
    "one two </s> three",  # a special token written in the text
    "x",
]


@pytest.mark.parametrize("bos_post_processor", [True, False])
def test_encode_matches_transformers(tmp_path: Path, bos_post_processor: bool) -> None:
    directory = write_tiny_tokenizer(tmp_path / "tok", bos_post_processor=bos_post_processor)
    ours = Tokenizer.from_dir(directory)
    reference = AutoTokenizer.from_pretrained(str(directory))
    for text in TEXTS:
        assert ours.encode(text) == reference(text)["input_ids"], text
    first = ours.encode("Hello")
    assert (first[0] == BOS_ID) is bos_post_processor
    assert first.count(BOS_ID) <= 1


def test_special_token_ids_from_config(tokenizer: Tokenizer) -> None:
    assert (tokenizer.bos_token, tokenizer.bos_token_id) == ("<s>", BOS_ID)
    assert (tokenizer.eos_token, tokenizer.eos_token_id) == ("</s>", EOS_ID)


def test_decode_skips_special_and_out_of_vocab(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("Hello world")
    assert tokenizer.decode([*ids, EOS_ID]) == "Hello world"
    assert tokenizer.decode([*ids, tokenizer.vocab_size + 7]) == "Hello world"


def test_missing_tokenizer_is_a_value_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"no tokenizer\.json"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="cannot load tokenizer"):
        Tokenizer.from_dir(tmp_path)
