"""GGUF metadata in full: the values ``gguf.GGUFReader`` reads, from the right file."""

from __future__ import annotations

import shutil
from pathlib import Path

import gguf
import pytest

from model_shards.gguf.files import gguf_files, is_gguf
from model_shards.gguf.metadata import read_gguf_metadata
from tests.server.text.gguf_vocab_files import smollm2_gguf


def test_same_values_as_gguf_reader() -> None:
    path = smollm2_gguf()
    ours = read_gguf_metadata(path)
    fields = {k: f for k, f in gguf.GGUFReader(path).fields.items() if not k.startswith("GGUF.")}
    assert set(ours) == set(fields)
    for key, field in fields.items():
        assert ours[key] == pytest.approx(field.contents()), key
    assert len(ours["tokenizer.ggml.tokens"]) == 49152
    assert ours["tokenizer.ggml.merges"][0] == "Ġ t"
    assert ours["tokenizer.ggml.add_bos_token"] is False


def test_metadata_file_of_a_model_path(tmp_path: Path) -> None:
    """What the tokenizer reads: shard 1 of the checkpoint a file or directory names."""
    assert not is_gguf(tmp_path)  # empty; and a Hugging Face directory below
    (tmp_path / "config.json").write_text("{}")
    one = tmp_path / "m.gguf"
    one.write_bytes(b"GGUF")
    assert not is_gguf(tmp_path) and is_gguf(one) and gguf_files(one)[0] == one
    split = tmp_path / "split"
    split.mkdir()
    for i in (1, 2, 3):
        (split / f"big-{i:05d}-of-00003.gguf").write_bytes(b"GGUF")
    first = split / "big-00001-of-00003.gguf"
    assert gguf_files(split)[0] == gguf_files(split / "big-00003-of-00003.gguf")[0] == first
    first.unlink()
    with pytest.raises(ValueError, match=r"missing: big-00001-of-00003\.gguf"):
        gguf_files(split)


def test_broken_files_are_value_errors(tmp_path: Path) -> None:
    cut = tmp_path / "cut.gguf"
    with smollm2_gguf().open("rb") as whole:
        cut.write_bytes(whole.read(4096))
    with pytest.raises(ValueError, match="cut short"):
        read_gguf_metadata(cut)
    for name, data in (("empty.gguf", b""), ("text.gguf", b"hello, not a model")):
        (tmp_path / name).write_bytes(data)
        with pytest.raises(ValueError, match=name):
            read_gguf_metadata(tmp_path / name)
    shutil.rmtree(tmp_path)
    with pytest.raises(ValueError, match="cannot read GGUF metadata"):
        read_gguf_metadata(tmp_path / "gone.gguf")
