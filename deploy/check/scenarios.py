"""What the deploy check asks of a running deployment, through its published port."""

from __future__ import annotations

import json
import re
import time
from datetime import UTC, datetime
from pathlib import Path

import httpx

from deploy.check.compose import Compose, output_tail
from deploy.check.steps import StepFailed

PROMPTS = ("Hello", "The quick brown fox", "Once upon a time, in a land far away,")


def _expect(ok: bool, message: str) -> None:
    if not ok:
        raise StepFailed(message)


def completion(base_url: str) -> str:
    """A greedy 8-token completion; its text."""
    body = {"prompt": "Hello", "max_tokens": 8, "temperature": 0}
    reply = httpx.post(f"{base_url}/v1/completions", json=body, timeout=120)
    _expect(reply.status_code == 200, f"/v1/completions {reply.status_code}: {reply.text}")
    answer = reply.json()
    _expect(answer["usage"]["completion_tokens"] == 8, f"not 8 tokens: {answer}")
    return str(answer["choices"][0]["text"])


def streamed_chat(base_url: str) -> int:
    """A streamed chat completion read as server-sent events up to ``[DONE]``; the number
    of content chunks (at least one, and a finish reason seen)."""
    body = {
        "messages": [{"role": "user", "content": "Say something."}],
        "max_tokens": 12,
        "temperature": 0,
        "stream": True,
    }
    chunks, finished, done = 0, False, False
    with httpx.stream("POST", f"{base_url}/v1/chat/completions", json=body, timeout=120) as r:
        _expect(r.status_code == 200, f"/v1/chat/completions {r.status_code}: {r.read()!r}")
        _expect(r.headers["content-type"].startswith("text/event-stream"), str(r.headers))
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            choice = json.loads(line[6:])["choices"][0]
            chunks += bool(choice["delta"].get("content"))
            finished = finished or choice.get("finish_reason") is not None
    _expect(done and finished and chunks > 0, f"stream: {chunks} chunks, finish {finished}")
    return chunks


def metrics(base_url: str) -> float:
    """Scrape ``/metrics``; the generated-token counter (positive after the requests)."""
    reply = httpx.get(f"{base_url}/metrics", timeout=30)
    _expect(reply.status_code == 200, f"/metrics {reply.status_code}")
    found = re.search(r"^shardserve_generation_tokens_total(?:\{[^}]*\})? (\S+)$", reply.text, re.M)
    _expect(found is not None, "no shardserve_generation_tokens_total in /metrics")
    assert found is not None
    tokens = float(found.group(1))
    _expect(tokens > 0, f"shardserve_generation_tokens_total is {tokens}")
    return tokens


def loadtest(compose: Compose, service: str, report: Path, requests: int) -> str:
    """``run --rm`` the compose load-test ``service`` to completion; read its JSON
    report back (every request completed, none failed). A one-line summary.

    ``--no-deps``: the server is up and healthy already; against podman's API a plain
    ``run`` was seen to recreate its container first (and wait for it again, minutes)."""
    report.unlink(missing_ok=True)
    began = datetime.now(UTC)
    run = compose.run("run", "--rm", "--no-deps", "--no-TTY", service, timeout=900)
    ended = datetime.now(UTC)
    _expect(report.is_file(), f"{service} wrote no {report}; it said:\n{output_tail(run)}")
    result = json.loads(report.read_text())
    _expect(result.get("schema") == "shardserve.loadtest", f"not a load-test report: {report}")
    point = result["points"][0]["metrics"]
    _expect(point["completed"] == requests, f"{point['completed']}/{requests} completed")
    _expect(not point["errors"], f"errors: {point['errors']}")
    started = datetime.fromisoformat(result["started_at"])
    return (
        f"{point['completed']} requests in {point['duration_s']:.1f}s; the load test began "
        f"{max(0.0, (started - began).total_seconds()):.0f}s after `run` and `run` "
        f"returned {(ended - started).total_seconds():.0f}s after that"
    )


def greedy(base_url: str, max_tokens: int = 16) -> list[str]:
    """Greedy completions of :data:`PROMPTS` (texts, ``max_tokens`` each, EOS ignored)."""
    texts: list[str] = []
    for prompt in PROMPTS:
        body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
        reply = httpx.post(f"{base_url}/v1/completions", json=body, timeout=120)
        _expect(reply.status_code == 200, f"{prompt!r}: {reply.status_code} {reply.text}")
        texts.append(str(reply.json()["choices"][0]["text"]))
    return texts


def wait_http_health(base_url: str, timeout: float) -> None:
    """Block until ``/health`` answers 200 (``StepFailed`` after ``timeout`` seconds)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{base_url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise StepFailed(f"{base_url}/health not 200 within {timeout:.0f}s")


def rank_pids(logs: str) -> list[int]:
    """The rank pids of the last ``started``/``recovered`` line of a serve log."""
    found = re.findall(r"rank pids \[([\d, ]+)\]", logs)
    _expect(bool(found), "no 'rank pids [...]' line in the log")
    return [int(pid) for pid in found[-1].split(",")]


def kill_rank(compose: Compose, service: str, base_url: str, timeout: float = 300) -> str:
    """``kill -9`` rank 0 inside ``service``'s container (``exec``); ``/health`` must go
    503 (the supervisor saw it; the container's own health check fails then) and then 200
    (restarted; the health check passes), the log must say recovered and a completion
    must work again. A summary with the observed times."""
    pid = rank_pids(compose.logs(service))[0]
    compose("exec", "-T", service, "sh", "-c", f"kill -9 {pid}")
    killed = time.monotonic()
    codes: list[int] = []
    unhealthy_at, check_failed = -1.0, False
    while time.monotonic() - killed < timeout:
        try:
            code = httpx.get(f"{base_url}/health", timeout=2).status_code
        except httpx.HTTPError:
            code = 0
        if not codes or codes[-1] != code:
            codes.append(code)
            if code == 503:
                unhealthy_at = time.monotonic() - killed
                check_failed = not compose.own_health_passes(service)
            if code == 200 and 503 in codes:
                break
        time.sleep(0.1)
    _expect(503 in codes and codes[-1] == 200, f"/health went {codes} after kill -9 {pid}")
    back = time.monotonic() - killed
    _expect(check_failed, "the container's health check passed while /health was 503")
    _expect(compose.own_health_passes(service), "the health check fails after recovery")
    _expect("recovered" in compose.logs(service), "the log has no 'recovered' line")
    completion(base_url)
    return (
        f"rank pid {pid}: /health {codes} (the container's health check failing, then "
        f"passing), 503 at {unhealthy_at:.1f}s, 200 at {back:.1f}s"
    )
