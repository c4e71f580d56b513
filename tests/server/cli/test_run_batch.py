"""``shardserve run-batch``: a file of good and bad lines on the built-in tiny model (one
engine start, tp=1 on CPU), resuming an output file; the file mistakes exit 2 before spawning."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from model_shards.launch.default_model import ensure_default_model
from tests.live_server import REPO, TEST_DEVICE
from tests.server.cli.spawn_guard import error_line, run_cli

TEMPLATE = Path(__file__).parents[2] / "families" / "qwen3_chat_template.jinja"
CHAT = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4, "temperature": 0}


def _line(custom_id: str, url: str, body: dict[str, Any]) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


LINES = [
    _line("chat-1", "/v1/chat/completions", CHAT),
    _line("cmpl-1", "/v1/completions", {"prompt": "Hello world", "max_tokens": 3}),
    _line("embed-1", "/v1/embeddings", {"input": "Hello"}),  # a generative model: a 400
    _line("bad-body", "/v1/completions", {"prompt": "x", "max_tokens": -1}),  # a 400
    _line("bad-url", "/v1/files", {}),
    _line("streamed", "/v1/chat/completions", {**CHAT, "stream": True}),
    '{"custom_id": "cut',  # not JSON
    "",  # blank lines are skipped
    _line("done-before", "/v1/completions", {"prompt": "never sent"}),
]
EARLIER = {"id": "batch_req_0", "custom_id": "done-before", "response": None, "error": None}


@pytest.mark.timeout(240)
def test_run_batch_good_and_bad_lines_resuming(tmp_path: Path) -> None:
    toy = tmp_path / "model"
    shutil.copytree(ensure_default_model(tmp_path / "cache"), toy)
    shutil.copy(TEMPLATE, toy / "chat_template.jinja")  # for the chat line
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("\n".join(LINES) + "\n")
    out.write_text(json.dumps(EARLIER) + "\n" + '{"custom_id": "chat-1", "resp')  # crashed
    command = [sys.executable, "-m", "server.cli", "run-batch", "-i", str(source), "-o", str(out)]
    command += ["--model", str(toy), "--device", TEST_DEVICE, "--max-concurrency", "3"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=200)
    assert done.returncode == 0, done.stderr
    assert "run-batch" in done.stderr and "7/7" in done.stderr  # the progress bar
    first, *records = [json.loads(line) for line in out.read_text().splitlines()]
    assert first == EARLIER  # kept; its line was not run again; the cut record is gone
    by_id = {r["custom_id"]: r for r in records}
    assert len(records) == 7 and set(by_id) == {
        "chat-1",
        "cmpl-1",
        "embed-1",
        "bad-body",
        "bad-url",
        "streamed",
        None,
    }
    assert all(r["id"].startswith("batch_req_") for r in records)
    for custom_id, kind in (("chat-1", "chat.completion"), ("cmpl-1", "text_completion")):
        response = by_id[custom_id]["response"]
        assert by_id[custom_id]["error"] is None and response["status_code"] == 200
        assert response["body"]["object"] == kind and response["request_id"].startswith("batch-")
        assert response["body"]["usage"]["completion_tokens"] <= 4
    for custom_id, param in (("embed-1", "model"), ("bad-body", "max_tokens")):
        response = by_id[custom_id]["response"]
        assert response["status_code"] == 400 and response["body"]["error"]["param"] == param
    for custom_id, words in (("bad-url", "url"), ("streamed", "stream"), (None, "not JSON")):
        record = by_id[custom_id]
        assert record["response"] is None and record["error"]["code"] == "invalid_request"
        assert words in record["error"]["message"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("lines", "output", "flag"),
    [
        (None, "out.jsonl", "--input-file"),  # no such file
        ([_line("a", "/v1/completions", {}), _line("a", "/v1/completions", {})], "o", "--input"),
        ([_line("a", "/v1/completions", {})], "missing-dir/out.jsonl", "--output-file"),
    ],
)
def test_file_mistakes_exit_2_before_spawning(
    tmp_path: Path,
    no_spawning: None,
    capsys: pytest.CaptureFixture[str],
    lines: list[str] | None,
    output: str,
    flag: str,
) -> None:
    source = tmp_path / "in.jsonl"
    if lines is not None:
        source.write_text("\n".join(lines))
    argv = ["run-batch", "-i", str(source), "-o", str(tmp_path / output), "--model", "none"]
    assert run_cli(argv) == 2
    assert flag in error_line(capsys.readouterr().err)


def test_reasoning_parser_flag(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_cli(["serve", "--reasoning-parser", "o1"]) == 2
    assert "--reasoning-parser" in error_line(capsys.readouterr().err)
