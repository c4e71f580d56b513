"""``shardserve serve``: flag errors exit 2 before spawning; start-up and shutdown reap the ranks.

Process tests run the real CLI in a subprocess with a fake ``model_shards.launch.replicas``
(tests/server/cli_runner.py) and a free port (``--port 0``).
"""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import types
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from model_shards.launch.packaged_model import SERVED_NAME
from server.cli.args import build_parser
from server.cli.serve import main
from server.cli.startup import served_name
from tests.server.conftest import write_tiny_model_config, write_tiny_tokenizer

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = write_tiny_tokenizer(tmp_path_factory.mktemp("models") / "tiny-llama")
    write_tiny_model_config(directory, vocab_size=400)
    return directory


@pytest.fixture
def no_spawning(monkeypatch: pytest.MonkeyPatch) -> None:
    def start_replica(*args: object, **kwargs: object) -> None:
        raise AssertionError("a replica was started for an invalid configuration")

    fake = types.ModuleType("model_shards.launch.replicas")
    fake.start_replica = start_replica  # type: ignore[attr-defined]
    fake.start_replicas = start_replica  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "model_shards.launch.replicas", fake)


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["-tp", "3"], "--tensor-parallel-size 3"),
        (["-pp", "5"], "--pipeline-parallel-size 5"),
        (["--max-model-len", "100000"], "--max-model-len 100000"),
        (["--max-num-seqs", "0"], "--max-num-seqs"),
    ],
)
def test_invalid_layout_exits_2_before_spawning(
    model_dir: Path,
    no_spawning: None,
    capsys: pytest.CaptureFixture[str],
    extra: list[str],
    needle: str,
) -> None:
    assert main(["serve", "--model", str(model_dir), "--port", "0", *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith("shardserve: error: ") and needle in err
    assert "Traceback" not in err


@pytest.mark.timeout(60)
def test_missing_model_dir_subprocess(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "server.cli", "serve", "--model", str(tmp_path / "nope")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=50,
    )
    assert result.returncode == 2
    assert (
        result.stderr.strip()
        == f"shardserve: error: --model {tmp_path / 'nope'}: not a directory nor a .gguf file"
    )


class Server:
    """A ``shardserve serve`` subprocess whose stderr is read line by line."""

    def __init__(self, model_dir: Path, tmp_path: Path, mode: str, *args: str) -> None:
        self.record = tmp_path / "record.json"
        env = {
            **os.environ,
            "FAKE_MODEL_DIR": str(model_dir),
            "FAKE_REPLICA_MODE": mode,
            "FAKE_REPLICA_RECORD": str(self.record),
            "PYTHONPATH": str(REPO),
        }
        command = [sys.executable, "-m", "tests.server.cli_runner", "serve", "--port", "0", *args]
        self.proc = subprocess.Popen(
            command, cwd=REPO, env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        self._pump_thread = threading.Thread(target=self._pump, daemon=True)
        self._pump_thread.start()

    def _pump(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.put(line)

    def wait_for_line(self, pattern: str, timeout: float = 30) -> re.Match[str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=0.1)
            except queue.Empty:
                continue
            self.seen.append(line)
            if match := re.search(pattern, line):
                return match
        raise AssertionError(f"no line matching {pattern!r} in:\n{''.join(self.seen)}")

    def finish(self, timeout: float = 30) -> tuple[int, str]:
        code = self.proc.wait(timeout)
        self._pump_thread.join(timeout)  # it ends at stderr's end: every line is queued
        while not self.lines.empty():
            self.seen.append(self.lines.get())
        return code, "".join(self.seen)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


@pytest.fixture
def launch(model_dir: Path, tmp_path: Path) -> Iterator[Callable[..., Server]]:
    """``launch(mode, *flags)``: a started server, killed at teardown if still running."""
    servers: list[Server] = []

    def start(mode: str, *args: str) -> Server:
        servers.append(Server(model_dir, tmp_path, mode, *args))
        return servers[-1]

    yield start
    for server in servers:
        server.kill()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_serve_then_signal_stops_everything(launch: Callable[..., Server], signum: int) -> None:
    server = launch("ready")
    match = server.wait_for_line(r"serving (\S+) on (http://127\.0\.0\.1:\d+)")
    name, url = match.group(1), match.group(2)
    assert name == SERVED_NAME  # no --model: the packaged model's name (its file faked here)
    with httpx.Client(base_url=url, timeout=10) as http:
        assert http.get("/health").status_code == 200
        assert http.get("/v1/models").json()["data"][0]["id"] == name
        response = http.post("/v1/completions", json={"prompt": "Hello world", "max_tokens": 2})
        assert (
            response.status_code == 200 and response.json()["choices"][0]["text"] == "Hello world"
        )
    server.proc.send_signal(signum)
    code, log = server.finish()
    assert code == 0, log
    record = json.loads(server.record.read_text())
    assert record["stopped"] and record["shutdowns"] == 1, log


@pytest.mark.timeout(90)
def test_sigterm_during_startup_stops_ranks(launch: Callable[..., Server]) -> None:
    server = launch("never_ready")
    server.wait_for_line(r"started replica")
    server.wait_for_line(r"fake replica: got Hello")  # the frontend waits for EngineReady
    server.proc.send_signal(signal.SIGTERM)
    code, log = server.finish()
    assert code == 128 + signal.SIGTERM, log
    assert "interrupted by SIGTERM during start-up" in log
    assert json.loads(server.record.read_text())["stopped"]


@pytest.mark.timeout(90)
def test_rank_death_before_ready_exits_1(launch: Callable[..., Server]) -> None:
    server = launch("dies", "--served-model-name", "x")
    code, log = server.finish()
    assert code == 1, log
    assert "rank 1: 3" in log and "Traceback" not in log
    assert json.loads(server.record.read_text())["stopped"]


def test_api_key_and_body_limit_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    from server.cli.args import API_KEY_ENV, build_parser

    monkeypatch.delenv(API_KEY_ENV, raising=False)
    args = build_parser().parse_args(["serve"])
    assert args.api_key is None and args.max_request_bytes == 8 * 1024 * 1024
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    args = build_parser().parse_args(["serve", "--max-request-bytes", "1000"])
    assert (args.api_key, args.max_request_bytes) == ("from-env", 1000)
    assert build_parser().parse_args(["serve", "--api-key", "flag"]).api_key == "flag"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--max-request-bytes", "0"])


def test_broken_chat_template_exits_2_before_spawning(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = write_tiny_tokenizer(tmp_path / "m", chat_template="{% for %}")
    write_tiny_model_config(model, vocab_size=400)
    assert main(["serve", "--model", str(model), "--device", "cpu"]) == 2
    assert "chat template does not compile" in capsys.readouterr().err


def test_a_signal_that_logging_swallowed_still_stops_start_up() -> None:
    """SIGTERM inside a logging call: the handler's Stop is caught and dropped by
    logging's StreamHandler, yet start-up still sees the signal before serving."""
    import io
    import logging
    import os
    import signal

    from server.cli.signals import ServeState, SignalGuard, Stop, raise_if_signalled

    class SignallingStream(io.StringIO):
        def write(self, text: str) -> int:
            os.kill(os.getpid(), signal.SIGTERM)  # arrives mid-emit
            return super().write(text)

    state = ServeState()
    guard = SignalGuard(state)
    log = logging.getLogger("test-swallowed-signal")
    handler = logging.StreamHandler(SignallingStream())
    log.addHandler(handler)
    try:
        log.warning("serving")  # raises Stop inside emit: logging reports and drops it
        with pytest.raises(Stop):
            raise_if_signalled(state)
    finally:
        log.removeHandler(handler)
        guard.restore()


def test_served_name_defaults(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SHARDSERVE_MODEL", raising=False)

    def name(*flags: str) -> str:
        return served_name(build_parser().parse_args(["serve", *flags]))

    gguf = tmp_path / "Model.Q4_1.gguf"
    gguf.write_bytes(b"GGUF")
    assert name("--model", str(gguf)) == "Model.Q4_1"
    assert name("--model", str(tmp_path)) == tmp_path.name
    assert name("--model", str(gguf), "--served-model-name", "m") == "m"
    assert name() == SERVED_NAME
