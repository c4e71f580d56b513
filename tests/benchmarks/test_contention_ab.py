"""The A/B driver's variant syntax and its environment while a server starts (no servers)."""

from __future__ import annotations

import argparse
import os

import pytest

from benchmarks.contention_ab import parse_variant
from model_shards.launch import environment_with


def test_variants_name_their_environment() -> None:
    assert parse_variant("bind=") == ("bind", {})
    assert parse_variant("base=SHARDSERVE_BIND_THREAD=0;OMP_WAIT_POLICY=PASSIVE") == (
        "base",
        {"SHARDSERVE_BIND_THREAD": "0", "OMP_WAIT_POLICY": "PASSIVE"},
    )
    for bad in ("bind", "=X=1", "base=NOVALUE"):
        with pytest.raises(argparse.ArgumentTypeError, match="--variant"):
            parse_variant(bad)


def test_the_environment_is_restored(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AB_KEPT", "old")
    monkeypatch.delenv("AB_NEW", raising=False)
    with environment_with({"AB_KEPT": "new", "AB_NEW": "1"}):
        assert os.environ["AB_KEPT"] == "new" and os.environ["AB_NEW"] == "1"
    assert os.environ["AB_KEPT"] == "old" and "AB_NEW" not in os.environ
