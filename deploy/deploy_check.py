"""``make deploy-check``: build the image and run the compose deployment for real.

Synopsis::

    python deploy/deploy_check.py      # as root, with podman, runc and debootstrap installed

Steps (each printed with its time; the first failure is named and the exit status is 1):
the prerequisites; podman's private settings; the Debian base image (cached); the torch
CPU wheel (cached); ``podman build`` of the CPU image (layers cached); podman's
Docker-compatible API on a private socket; then, with the real Compose v2 binary:

- ``docker-compose.yml``, profile ``cpu``: ``up -d``, the container ``healthy``, a
  completion, a streamed chat, ``/metrics``, the ``loadtest-cpu`` service to completion and
  its JSON report, ``kill -9`` of a rank via ``exec`` (``/health`` 503 then 200), ``down``
  and nothing of the project left;
- ``docker-compose.multinode.yml`` (+ ``docker-compose.multinode.cpu.yml``): two engine
  "nodes" form one tp=2 replica over torchrun (gloo), the frontend serves it, and greedy
  output equals ``shardserve serve`` outside containers; ``down``, nothing left.

The API service is stopped at the end, whatever happened. docs/deploy.md tells more.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the ``deploy`` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx

from deploy.check import podman, scenarios
from deploy.check.compose import Compose, compose_binary
from deploy.check.steps import StepFailed, Steps
from model_shards.launch.packaged_model import SERVED_NAME

LOADTEST_REQUESTS = 16
HEALTHY_TIMEOUT_S = 900.0


def free_port() -> int:
    """A TCP port nothing listens on now (host side)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def prerequisites() -> None:
    """Root, podman, runc, debootstrap and the Compose binary, or ``StepFailed`` saying
    how to get them."""
    missing = podman.missing_tools()
    if missing:
        raise StepFailed(f"{', '.join(missing)} not found; {podman.INSTALL_HINT}")
    if os.geteuid() != 0:
        raise StepFailed("run as root (debootstrap and rootful podman)")
    if compose_binary() is None:
        raise StepFailed("docker-compose not beside the interpreter: make install")


@contextlib.contextmanager
def finally_down(steps: Steps, compose: Compose, name: str) -> Iterator[None]:
    """Run the block; then, whatever happened, ``down`` the project as step ``name`` and
    check that none of its containers, networks or volumes (nor a new dangling volume)
    are left."""
    before = set(podman.run(["podman", "volume", "ls", "-q", "-f", "dangling=true"]).split())
    try:
        yield
    finally:
        with steps.step(name):
            compose.down()
            dangling = podman.run(["podman", "volume", "ls", "-q", "-f", "dangling=true"])
            left = compose.leftovers() + [f"dangling volume {v}" for v in dangling.split()]
            left = [item for item in left if item.split()[-1] not in before]
            if left:
                raise StepFailed(f"left behind: {left}")


CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def write_model(models: Path) -> Path:
    """The built-in model's checkpoint in ``models/default-model``, with a chat template
    (the built-in has none), readable by the image's user; its path inside the mount."""
    from model_shards.launch.default_model import write_default_model

    target = models / "default-model"
    write_default_model(target)
    config_path = target / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "chat_template": CHAT_TEMPLATE}, indent=2))
    for path in [models, *models.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    return Path("/models") / target.name


def image_defaults(steps: Steps) -> None:
    """The image as is: default command, no model mounted, the packaged SmolLM2 GGUF served
    by user 10001, its own ``HEALTHCHECK`` passing."""
    port = free_port()
    with podman.plain_container(port) as name:
        seconds = podman.wait_own_healthcheck(name, HEALTHY_TIMEOUT_S)
        user = podman.run(["podman", "exec", name, "id", "-u"], quiet=True).strip()
        models = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=30).json()
        served = [model["id"] for model in models["data"]]
        if user != "10001" or served != [SERVED_NAME]:
            raise StepFailed(f"user {user}, models {served}")
        text = scenarios.completion(f"http://127.0.0.1:{port}")
        steps.say(f"healthy after {seconds:.0f}s as uid {user}, {served[0]}: {text!r}")


def one_node(steps: Steps, docker_host: str, work: Path) -> None:
    """``docker-compose.yml``, profile ``cpu``, end to end (see the module docstring),
    serving the checkpoint mounted from ``work/models``."""
    port, results = free_port(), work / "results"
    results.mkdir()
    results.chmod(0o777)  # the load test writes its report as the image's user 10001
    env = {
        "PORT": str(port),
        "RESULTS_DIR": str(results),
        "MODELS_DIR": str(work / "models"),
        "MODEL_PATH": "/models/default-model",
        "LOADTEST_REQUESTS": str(LOADTEST_REQUESTS),
        "LOADTEST_CONCURRENCY": "4",
    }
    compose = Compose("shardserve-check", ["docker-compose.yml"], docker_host, env, ["cpu"])
    url, service = f"http://127.0.0.1:{port}", "shardserve-cpu"
    with (
        finally_down(steps, compose, "cpu: down, nothing left"),
        podman.health_ticker(compose.project),
    ):
        with steps.step("cpu: compose up -d shardserve-cpu"):
            compose("up", "-d", "--no-build", "--pull", "never", service)
        with steps.step("cpu: container healthy"):
            steps.say(f"healthy after {compose.wait_healthy(service, HEALTHY_TIMEOUT_S):.0f}s")
        with steps.step("cpu: completion through the published port"):
            steps.say(f"text {scenarios.completion(url)!r}")
        with steps.step("cpu: streamed chat"):
            steps.say(f"{scenarios.streamed_chat(url)} content chunks")
        with steps.step("cpu: /metrics scraped"):
            steps.say(f"shardserve_generation_tokens_total {scenarios.metrics(url):.0f}")
        with steps.step("cpu: loadtest-cpu service, JSON report read back"):
            report = results / "loadtest.json"
            steps.say(scenarios.loadtest(compose, "loadtest-cpu", report, LOADTEST_REQUESTS))
        with steps.step("cpu: kill -9 a rank (exec): restarted, /health 503 then 200"):
            steps.say(scenarios.kill_rank(compose, service, url))
        with steps.step("cpu: container healthy again"):
            compose.wait_healthy(service, HEALTHY_TIMEOUT_S)


def outside_containers(model: Path, log: Path) -> list[str]:
    """Greedy outputs of ``shardserve serve --model <model> -tp 2`` run on this host
    (its output goes to ``log``)."""
    port = free_port()
    shardserve = Path(sys.executable).parent / "shardserve"
    argv = [str(shardserve), "serve", "--model", str(model), "-tp", "2", "--device", "cpu"]
    with log.open("w") as out:
        server = subprocess.Popen([*argv, "--port", str(port)], stdout=out, stderr=out)
    try:
        scenarios.wait_http_health(f"http://127.0.0.1:{port}", HEALTHY_TIMEOUT_S)
        return scenarios.greedy(f"http://127.0.0.1:{port}")
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def multinode(steps: Steps, docker_host: str, work: Path) -> None:
    """``docker-compose.multinode.yml`` on one host, compared with ``shardserve serve``."""
    models = work / "models"
    with steps.step("multinode: reference, shardserve serve -tp 2 outside containers"):
        expected = outside_containers(models / "default-model", work / "reference.log")
    port = free_port()
    env = {
        "DEVICE": "cpu",
        "MODELS_DIR": str(models),
        "MODEL_PATH": "/models/default-model",
        "TP": "2",
        "PP": "1",
        "PORT": str(port),
        "ENGINE_PORT": str(free_port()),
        "RDZV_PORT": str(free_port()),
        "RDZV_ID": f"deploy-check-{os.getpid()}",
        "SHARDSERVE_ENGINE_TOKEN": secrets.token_hex(32),
    }
    files = ["docker-compose.multinode.yml", "docker-compose.multinode.cpu.yml"]
    compose = Compose("shardserve-check-multinode", files, docker_host, env)
    with (
        finally_down(steps, compose, "multinode: down, nothing left"),
        podman.health_ticker(compose.project),
    ):
        with steps.step("multinode: compose up -d (node0, node1, frontend)"):
            compose("up", "-d", "--no-build", "--pull", "never", timeout=HEALTHY_TIMEOUT_S)
        with steps.step("multinode: frontend healthy"):
            compose.wait_healthy("frontend", HEALTHY_TIMEOUT_S)
        with steps.step("multinode: greedy output equals shardserve serve outside"):
            got = scenarios.greedy(f"http://127.0.0.1:{port}")
            if got != expected:
                raise StepFailed(f"containers {got!r} != outside {expected!r}")
            steps.say(f"{len(got)} prompts equal, e.g. {got[0]!r}")


def checks(steps: Steps) -> None:
    """Every step in order (the first failure propagates)."""
    with steps.step("prerequisites (podman, runc, debootstrap, docker-compose)"):
        prerequisites()
    with steps.step("podman settings (runc, cgroupfs, ulimits)"):
        steps.say(str(podman.containers_conf()))
    with steps.step("base image (debootstrap bookworm minbase)"):
        steps.say(podman.ensure_base())
    with steps.step("torch CPU wheel"):
        wheels = podman.ensure_torch_wheel()
    with steps.step(f"podman build {podman.IMAGE}"):
        podman.build_image(wheels)
    with steps.step("image as is: built-in model, non-root, HEALTHCHECK passes"):
        image_defaults(steps)
    with tempfile.TemporaryDirectory(prefix="shardserve-deploy-check-") as tmp:
        work = Path(tmp)
        work.chmod(0o755)
        with steps.step("a checkpoint to mount (the built-in model + a chat template)"):
            write_model(work / "models")
        with steps.step("podman system service (private socket)"):
            service = podman.api_service(work / "podman.sock")
            docker_host = service.__enter__()
        try:
            one_node(steps, docker_host, work)
            multinode(steps, docker_host, work)
        finally:
            with steps.step("stop podman system service"):
                service.__exit__(None, None, None)


def main() -> int:
    """Run the check; 0 when every step passed, 1 otherwise (the step is named)."""
    steps = Steps()
    try:
        checks(steps)
    except (StepFailed, subprocess.SubprocessError, httpx.HTTPError, OSError, KeyError):
        pass  # reported by its step
    except KeyboardInterrupt:
        steps.failed = steps.failed or "interrupted"
    return steps.summary()


if __name__ == "__main__":
    sys.exit(main())
