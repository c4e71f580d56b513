"""Which files a ``--model`` path names, and the header refusals: every mistake a
``ValueError`` naming the path (or the tensor, or the architecture) and what would do."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from model_shards.config.model import ModelConfig, load_model_config
from model_shards.gguf.architectures import hf_config
from model_shards.gguf.files import gguf_files, is_gguf
from model_shards.gguf.reader import read_gguf


def write_stub_gguf(
    path: Path, arch: str = "llama", kind: gguf.GGMLQuantizationType | None = None
) -> Path:
    """A one-tensor GGUF of ``arch`` (its tensor of type ``kind``, F32 when ``None``)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(1)
    if kind is None:
        writer.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    else:  # raw blocks of ``kind``: 4 rows of one 256-element block
        size = gguf.GGML_QUANT_SIZES[kind][1]
        writer.add_tensor("token_embd.weight", np.zeros((4, size), np.uint8), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_file_a_directory_and_split_shards(tmp_path: Path) -> None:
    one = write_stub_gguf(tmp_path / "one" / "m.gguf")
    assert gguf_files(one) == gguf_files(one.parent) == [one]
    assert is_gguf(one) and is_gguf(one.parent)
    shards = [write_stub_gguf(tmp_path / "split" / f"m-{i:05d}-of-00003.gguf") for i in (1, 2, 3)]
    assert gguf_files(shards[1]) == gguf_files(tmp_path / "split") == shards
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    write_stub_gguf(tmp_path / "hf" / "extra.gguf")
    assert not is_gguf(tmp_path / "hf"), "a config.json makes it a Hugging Face checkpoint"


def test_refusals_name_the_path(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"empty: no \.gguf file in that directory"):
        gguf_files(tmp_path / "empty")
    write_stub_gguf(tmp_path / "two" / "a.gguf")
    write_stub_gguf(tmp_path / "two" / "b-00001-of-00002.gguf")
    write_stub_gguf(tmp_path / "two" / "b-00002-of-00002.gguf")
    with pytest.raises(ValueError, match=r"several GGUF checkpoints \(a\.gguf, b-\*-of-00002"):
        gguf_files(tmp_path / "two")
    first = write_stub_gguf(tmp_path / "gap" / "m-00001-of-00003.gguf")
    write_stub_gguf(tmp_path / "gap" / "m-00003-of-00003.gguf")
    with pytest.raises(ValueError, match=r"split GGUF shard\(s\) missing: m-00002-of-00003\.gguf"):
        gguf_files(first)
    (tmp_path / "bad.gguf").write_bytes(b"GGUF nonsense")
    with pytest.raises(ValueError, match=r"bad\.gguf: not a readable GGUF file"):
        read_gguf(tmp_path / "bad.gguf")
    (tmp_path / "m.bin").write_bytes(b"")
    with pytest.raises(ValueError, match=r"m\.bin: not a directory nor a \.gguf file"):
        gguf_files(tmp_path / "m.bin")


def test_unknown_architecture_and_tensor_type_are_named(tmp_path: Path) -> None:
    mamba = write_stub_gguf(tmp_path / "mamba.gguf", arch="mamba")
    served = "llama, qwen2, qwen3, gemma2, gemma3, phi3"
    with pytest.raises(ValueError, match=rf"architecture 'mamba' is not supported; .* {served}$"):
        ModelConfig.from_dir(mamba)
    iq = write_stub_gguf(tmp_path / "iq.gguf", kind=gguf.GGMLQuantizationType.Q2_K)
    supported = "F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K"
    with pytest.raises(ValueError, match=rf"'token_embd.weight' has type Q2_K.*: {supported}$"):
        load_model_config(iq)
    with pytest.raises(ValueError, match=r"missing GGUF metadata \('llama.embedding_length'\)"):
        hf_config(read_gguf(write_stub_gguf(tmp_path / "bare.gguf")))
