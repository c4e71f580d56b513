"""GGUF metadata: the values ``gguf.GGUFReader`` reads, and which file of a --model path."""

from __future__ import annotations

import shutil
from pathlib import Path

import gguf
import pytest

from model_shards.config.gguf_metadata import find_gguf, read_gguf_metadata
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


def test_find_gguf_file_directory_and_split_shards(tmp_path: Path) -> None:
    assert find_gguf(tmp_path) is None  # no GGUF: a Hugging Face directory
    (tmp_path / "config.json").write_text("{}")
    assert find_gguf(tmp_path / "config.json") is None
    one = tmp_path / "m.gguf"
    one.write_bytes(b"GGUF")
    assert find_gguf(tmp_path) == find_gguf(one) == one
    split = tmp_path / "split"
    split.mkdir()
    for i in (1, 2, 3):
        (split / f"big-{i:05d}-of-00003.gguf").write_bytes(b"GGUF")
    first = split / "big-00001-of-00003.gguf"
    assert find_gguf(split) == find_gguf(split / "big-00003-of-00003.gguf") == first
    first.unlink()
    with pytest.raises(ValueError, match=r"without its first shard big-00001-of-00003\.gguf"):
        find_gguf(split)
    (tmp_path / "other.gguf").write_bytes(b"GGUF")
    with pytest.raises(ValueError, match=r"several GGUF checkpoints \(m\.gguf, other\.gguf\)"):
        find_gguf(tmp_path)


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
