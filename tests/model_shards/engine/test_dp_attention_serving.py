"""``shardserve serve -dp 2 --enable-expert-parallel --dp-attention`` over HTTP: two
replicas (tp 1) sharing the experts of a tiny random Mixtral, 16 concurrent requests of
different lengths, replica 1 idle while the first request runs alone; every greedy
output equals the single-replica (tp 1, no dp) server's. Plus the CLI refusals (no spawn).
"""

from __future__ import annotations

import argparse
import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from model_shards.config.replica import ReplicaConfig
from model_shards.launch.dp_attention import check_dp_attention_model, start_dp_attention
from server.cli.args import build_parser
from server.cli.flag_checks import check_serve_flags
from tests.families import mixtral
from tests.live_server import live_server


def _body(i: int) -> dict[str, Any]:
    prompt = [(7 * i + j) % 400 + 3 for j in range(3 + (5 * i) % 17)]
    tokens = 30 if i == 0 else 4 + (5 * i) % 9
    return {"prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True}


def _complete(url: str, i: int) -> tuple[str, int]:
    r = httpx.post(f"{url}/v1/completions", json=_body(i), timeout=120)
    assert r.status_code == 200, r.text
    out = r.json()
    return out["choices"][0]["text"], out["usage"]["completion_tokens"]


def _run(url: str) -> list[tuple[str, int]]:
    """Request 0 alone for a while (on one replica: the other is idle), then 15 more
    concurrently while it still runs."""
    with ThreadPoolExecutor(16) as pool:
        first = pool.submit(_complete, url, 0)
        time.sleep(1.0)
        rest = [pool.submit(_complete, url, i) for i in range(1, 16)]
        return [first.result(), *(f.result() for f in rest)]


@pytest.fixture(scope="module")
def mixtral_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return mixtral.build(tmp_path_factory.mktemp("dpa") / "mixtral")


@pytest.mark.timeout(150)
def test_dp_attention_serves_what_one_replica_serves(mixtral_dir: Path, tmp_path: Path) -> None:
    common = ["--model", str(mixtral_dir), "--dtype", "float32", "--max-model-len", "128"]
    (tmp_path / "one").mkdir()
    (tmp_path / "dpa").mkdir()
    with live_server(common, tmp_path / "one") as server:
        expected = _run(server.url)
    flags = ["-dp", "2", "--enable-expert-parallel", "--dp-attention"]
    with live_server([*common, *flags], tmp_path / "dpa") as server:
        got = _run(server.url)
        log = server.log()
        metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
    routed = re.findall(
        r'^shardserve_replica_requests_total\{replica="(\S+)"\} (\S+)', metrics, re.M
    )
    assert len(routed) == 2 and all(float(n) > 0 for _, n in routed), metrics  # both served
    assert log.count("data-parallel attention replica serving on") == 2, log
    assert got == expected
    assert len({n for _, n in got}) > 3, "requests of different lengths"


def _serve_args(*flags: str) -> argparse.Namespace:
    return build_parser().parse_args(["serve", "--model", "m", *flags])


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["-dp", "2", "--dp-attention"], "needs --enable-expert-parallel"),
        (["--enable-expert-parallel", "--dp-attention"], "--data-parallel-size >= 2"),
        (["-dp", "2", "-tp", "2", "--enable-expert-parallel", "--dp-attention"], "tensor"),
        (["-dp", "2", "-pp", "2", "--enable-expert-parallel", "--dp-attention"], "pipeline"),
    ],
)
def test_bad_flag_combinations_are_refused(flags: list[str], needle: str) -> None:
    with pytest.raises(ValueError, match="--dp-attention") as err:
        check_serve_flags(_serve_args(*flags))
    assert needle in str(err.value)


def test_expert_count_must_split_over_the_replicas(mixtral_dir: Path) -> None:
    config = ReplicaConfig(str(mixtral_dir), enable_expert_parallel=True, dp_attention=True)
    with pytest.raises(ValueError, match=r"--dp-attention .* 8 experts .*valid sizes: \[2, 4, 8\]"):
        start_dp_attention(config, 3)  # refused before anything is spawned
    check_dp_attention_model(config, 4)


def test_a_dense_model_is_refused(tmp_path: Path) -> None:
    from tests.checkpoints import build_tiny_llama

    path = build_tiny_llama(tmp_path / "llama")
    config = ReplicaConfig(str(path), enable_expert_parallel=True, dp_attention=True)
    with pytest.raises(ValueError, match=r"--dp-attention: .* not a mixture-of-experts"):
        check_dp_attention_model(config, 2)


@pytest.mark.timeout(60)
def test_serve_exits_2_naming_the_flag(mixtral_dir: Path, tmp_path: Path) -> None:
    import subprocess
    import sys

    from tests.live_server import REPO

    flags = ["-dp", "3", "--enable-expert-parallel", "--dp-attention", "--port", "0"]
    proc = subprocess.run(
        [sys.executable, "-m", "server.cli", "serve", "--model", str(mixtral_dir), *flags],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=50,
    )
    assert proc.returncode == 2, proc.stderr
    assert "--dp-attention with --data-parallel-size 3" in proc.stderr
    assert "valid sizes: [2, 4, 8]" in proc.stderr
