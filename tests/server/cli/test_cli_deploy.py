"""Deployment flags of the CLI: ``serve --engine`` / ``-dp`` and ``engine`` exit 2 on misuse."""

from __future__ import annotations

from pathlib import Path

import pytest

from server.cli.serve import build_parser, main
from tests.server.conftest import write_tiny_model_config, write_tiny_tokenizer


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = write_tiny_tokenizer(tmp_path_factory.mktemp("models") / "tiny-llama")
    write_tiny_model_config(directory, vocab_size=400)
    return directory


def test_flags_parse() -> None:
    args = build_parser().parse_args(
        ["serve", "-dp", "2", "--engine", "tcp://a:1", "--engine", "tcp://b:2"]
    )
    assert args.data_parallel_size == 2 and args.engine == ["tcp://a:1", "tcp://b:2"]
    engine = build_parser().parse_args(["engine", "-tp", "2", "--nnodes", "2", "--node-rank", "1"])
    assert (engine.engine_host, engine.engine_port, engine.nnodes) == ("127.0.0.1", 5555, 2)
    assert engine.max_num_batched_tokens == 8192  # replica flags are shared with serve


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["serve", "--engine", "localhost:5555"], "--engine localhost:5555: expected tcp://"),
        (["serve", "--engine", "tcp://h:1", "-dp", "2"], "give one --engine per replica"),
        (["engine", "-tp", "2", "--nnodes", "2"], "--nnodes > 1 needs --rdzv-endpoint"),
        (["engine", "-tp", "2", "--nnodes", "3", "--rdzv-endpoint", "h:1"], "does not divide"),
        (["engine", "-tp", "3"], "--tensor-parallel-size 3"),
    ],
)
def test_misuse_exits_2_before_starting_anything(
    model_dir: Path, capsys: pytest.CaptureFixture[str], argv: list[str], needle: str
) -> None:
    assert main([*argv, "--model", str(model_dir), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("shardserve: error: ") and needle in err, err


TOKEN = ["--engine-token", "t" * 32]


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["serve", "--engine", "tcp://h:1"], "--engine-token (or $SHARDSERVE_ENGINE_TOKEN) is"),
        (["ping", "tcp://h:1"], "--engine-token (or $SHARDSERVE_ENGINE_TOKEN) is required to"),
    ],
)
def test_the_engine_port_needs_its_token(
    model_dir: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    argv: list[str],
    needle: str,
) -> None:
    """No frontend or probe of an engine without its token: exit 2 naming it (the engine's own
    refusal: tests/server/cli/test_cli_validation.py)."""
    monkeypatch.delenv("SHARDSERVE_ENGINE_TOKEN", raising=False)
    model = [] if argv[0] == "ping" else ["--model", str(model_dir), "--device", "cpu"]
    assert main([*argv, *model]) == 2
    err = capsys.readouterr().err
    assert err.startswith("shardserve: error: ") and needle in err, err


def test_ping_a_missing_engine_fails(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["ping", f"ipc://{tmp_path}/nobody", "--timeout", "0.2", *TOKEN]) == 1
    assert "not ready" in capsys.readouterr().err
