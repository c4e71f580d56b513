"""``shardserve serve --model X.gguf``: what the GGUF checks refuse exits 2 with one line
naming the file, the architecture or the tensor, before anything is spawned; the control, a
good tiny GGUF's directory (tokenizer files beside it), reaches spawning."""

from __future__ import annotations

import shutil
from pathlib import Path

import gguf
import pytest

from model_shards.config.vision_budget import MediaCaps
from server.media.multimodal import ImageModel
from tests.model_shards.gguf.test_files import write_stub_gguf
from tests.model_shards.gguf.tiny import build
from tests.server.cli.spawn_guard import Spawned, error_line, run_cli
from tests.server.conftest import write_tiny_tokenizer

SERVE = ["serve", "--port", "0", "--device", "cpu", "--model"]


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("gguf-cli")
    path = build("llama", directory)
    write_tiny_tokenizer(directory)
    return path


def _refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert run_cli(argv) == 2
    return error_line(capsys.readouterr().err)


@pytest.mark.timeout(60)
def test_gguf_mistakes_exit_2_naming_them(
    tmp_path: Path, llama: Path, no_spawning: None, capsys: pytest.CaptureFixture[str]
) -> None:
    mamba = write_stub_gguf(tmp_path / "mamba" / "m.gguf", arch="mamba")
    line = _refused([*SERVE, str(mamba)], capsys)
    assert "GGUF architecture 'mamba' is not supported" in line and "gemma3, phi3" in line
    q2k = write_stub_gguf(tmp_path / "q2k" / "m.gguf", kind=gguf.GGMLQuantizationType.Q2_K)
    line = _refused([*SERVE, str(q2k.parent)], capsys)
    assert "tensor 'token_embd.weight' has type Q2_K" in line and "Q6_K" in line
    two = tmp_path / "two"
    shutil.copytree(llama.parent, two)
    shutil.copy(llama, two / "other.gguf")
    line = _refused([*SERVE, str(two)], capsys)
    assert "several GGUF checkpoints (other.gguf, tiny-llama.gguf)" in line
    (tmp_path / "empty").mkdir()
    line = _refused([*SERVE, str(tmp_path / "empty")], capsys)
    assert "no config.json nor .gguf in that directory" in line
    shard = write_stub_gguf(tmp_path / "split" / "m-00001-of-00002.gguf")
    line = _refused([*SERVE, str(shard)], capsys)
    assert "split GGUF shard(s) missing: m-00002-of-00002.gguf" in line
    line = _refused([*SERVE, str(llama), "-tp", "3"], capsys)
    assert "--tensor-parallel-size 3" in line


@pytest.mark.timeout(60)
def test_a_good_gguf_reaches_spawning(llama: Path, no_spawning: None) -> None:
    """Its directory (the tokenizer read from the ``tokenizer.json`` beside it)."""
    with pytest.raises(Spawned):
        run_cli([*SERVE, str(llama.parent), "-tp", "2"])


def test_a_gguf_file_has_no_vision_and_default_media_caps(llama: Path) -> None:
    assert ImageModel.from_dir(llama) is None
    assert MediaCaps.from_dir(llama) == MediaCaps()
