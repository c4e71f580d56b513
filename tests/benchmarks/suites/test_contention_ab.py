"""The A/B driver's variant syntax (no servers; launch.environment_with, which starts its
servers with a variant's variables, is tested in tests/server/cli/test_cli_real_replica.py)."""

from __future__ import annotations

import argparse

import pytest

from benchmarks.suites.contention_ab import parse_variant


def test_variants_name_their_environment() -> None:
    assert parse_variant("bind=") == ("bind", {})
    assert parse_variant("base=SHARDSERVE_BIND_THREAD=0;OMP_WAIT_POLICY=PASSIVE") == (
        "base",
        {"SHARDSERVE_BIND_THREAD": "0", "OMP_WAIT_POLICY": "PASSIVE"},
    )
    for bad in ("bind", "=X=1", "base=NOVALUE"):
        with pytest.raises(argparse.ArgumentTypeError, match="--variant"):
            parse_variant(bad)
