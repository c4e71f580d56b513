"""Podman for the deploy check: its settings, the Debian base, the image and the
Docker-compatible API service on a private socket.

Podman runs with a private ``containers.conf`` (``CONTAINERS_CONF``): the ``runc`` runtime
(``crun`` refuses a hybrid cgroup layout), ``cgroupfs`` (no systemd needed) and default
ulimits no higher than this process's own (raising them is refused). No registry is
needed: the base is ``debootstrap --variant=minbase bookworm`` imported as an image, and
the CPU build of torch comes from a cached wheel mounted into the build.
"""

from __future__ import annotations

import contextlib
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from deploy.check.steps import StepFailed

REPO = Path(__file__).resolve().parents[2]
CACHE = REPO / "deploy" / ".cache"
BASE_IMAGE = "localhost/shardserve-base:bookworm"
IMAGE = "shardserve:cpu"
TORCH_VERSION = "2.13.0+cpu"
INSTALL_HINT = "as root: apt-get install -y podman runc debootstrap"
HOST_CA = Path("/etc/ssl/certs/ca-certificates.crt")


def run(argv: list[str], *, timeout: float = 600, quiet: bool = False) -> str:
    """Run ``argv`` under :func:`podman_env`; its stdout. A non-zero exit raises
    :class:`StepFailed` with the command and the tail of its output."""
    result = subprocess.run(
        argv, env=podman_env(), capture_output=True, text=True, timeout=timeout, check=False
    )
    if result.returncode != 0:
        tail = (result.stdout + result.stderr).strip()[-3000:]
        raise StepFailed(f"{' '.join(argv[:4])} ... exited {result.returncode}:\n{tail}")
    if not quiet and result.stdout.strip():
        print(result.stdout.strip()[-2000:], flush=True)
    return result.stdout


def missing_tools() -> list[str]:
    """The programs the check needs that are not on ``PATH``."""
    return [name for name in ("podman", "runc", "debootstrap") if shutil.which(name) is None]


def _limit(which: int, cap: int) -> int:
    """This process's soft limit ``which``, at most ``cap``."""
    soft, hard = resource.getrlimit(which)
    return min([cap, *(v for v in (soft, hard) if v != resource.RLIM_INFINITY)])


def containers_conf() -> Path:
    """Write (idempotently) and return the private ``containers.conf``."""
    CACHE.mkdir(parents=True, exist_ok=True)
    (CACHE / ".gitignore").write_text("*\n")
    # runc refuses limits above what it may set (here nproc=65536 fails, 4096 works)
    nofile, nproc = _limit(resource.RLIMIT_NOFILE, 65536), _limit(resource.RLIMIT_NPROC, 4096)
    conf = CACHE / "containers.conf"
    conf.write_text(
        "[containers]\n"
        f'default_ulimits = ["nofile={nofile}:{nofile}", "nproc={nproc}:{nproc}"]\n'
        "[engine]\n"
        'runtime = "runc"\ncgroup_manager = "cgroupfs"\nevents_logger = "file"\n'
    )
    return conf


def podman_env() -> dict[str, str]:
    """This process's environment with the private ``containers.conf``."""
    return {**os.environ, "CONTAINERS_CONF": str(CACHE / "containers.conf")}


def image_exists(name: str) -> bool:
    """Whether podman's store holds image ``name``."""
    argv = ["podman", "image", "exists", name]
    return subprocess.run(argv, env=podman_env(), check=False).returncode == 0


def ensure_base() -> str:
    """The Debian bookworm base (python3-venv, CA certificates) as :data:`BASE_IMAGE`:
    kept in podman's store; else imported from the cached tarball; else debootstrapped
    (and the tarball cached). Returns what was done."""
    if image_exists(BASE_IMAGE):
        return f"{BASE_IMAGE} cached"
    tarball = CACHE / "bookworm-minbase.tar"
    made = "imported from the cached tarball"
    if not tarball.is_file():
        mirror = os.environ.get("DEBIAN_MIRROR", "http://deb.debian.org/debian")
        with tempfile.TemporaryDirectory(dir=CACHE) as tmp:
            rootfs = Path(tmp) / "rootfs"
            include = "--include=python3-venv,ca-certificates"
            argv = ["debootstrap", "--variant=minbase", include, "bookworm", str(rootfs), mirror]
            run(argv, timeout=1800, quiet=True)
            partial = tarball.with_suffix(".partial")
            run(["tar", "-C", str(rootfs), "-cf", str(partial), "."], quiet=True)
            partial.rename(tarball)
        made = "debootstrapped"
    run(["podman", "import", str(tarball), BASE_IMAGE], quiet=True)
    return f"{BASE_IMAGE} {made}"


def ensure_torch_wheel() -> Path:
    """The directory holding the torch CPU wheel for the base's Python 3.11 (downloaded
    once: pip's own configuration first, else PyTorch's CPU index)."""
    wheels = CACHE / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    if any(wheels.glob(f"torch-{TORCH_VERSION}-cp311-*.whl")):
        return wheels
    base = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(wheels)]
    base += ["--only-binary=:all:", "--python-version", "3.11", f"torch=={TORCH_VERSION}"]
    for extra in ([], ["--index-url", "https://download.pytorch.org/whl/cpu"]):
        if subprocess.run(base + extra, check=False).returncode == 0:
            return wheels
    raise StepFailed(f"could not download torch=={TORCH_VERSION} (cp311) into {wheels}")


def build_image(wheels: Path) -> None:
    """``podman build`` the CPU target ``FROM`` the Debian base (Docker format, so the
    ``HEALTHCHECK`` is kept). torch comes from the mounted wheel (only ``+cpu`` matches),
    its dependencies and the project's from PyPI over the host's network; the host's CA
    bundle is handed to pip (a TLS-intercepting proxy). Layers are cached."""
    args = {
        "DEVICE": "cpu",
        "PYTHON_IMAGE": BASE_IMAGE,
        "TORCH_VERSION": TORCH_VERSION,
        "TORCH_INDEX_URL": os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple"),
        "PIP_FIND_LINKS": "/wheels",
    }
    argv = ["podman", "build", "--format", "docker", "--network", "host", "--pull=never"]
    argv += ["-v", f"{wheels}:/wheels:ro"]
    if HOST_CA.is_file():
        argv += ["-v", f"{HOST_CA}:/host-certs/ca.crt:ro"]
        args["PIP_CERT"] = "/host-certs/ca.crt"
    for key, value in args.items():
        argv += ["--build-arg", f"{key}={value}"]
    previous = image_id(IMAGE)
    log = CACHE / "build.log"
    with log.open("w") as out:
        built = subprocess.run(
            [*argv, "-t", IMAGE, str(REPO)],
            env=podman_env(),
            stdout=out,
            stderr=subprocess.STDOUT,
            timeout=3600,
            check=False,
        )
    if built.returncode != 0:
        tail = log.read_text()[-3000:]
        raise StepFailed(f"podman build exited {built.returncode} (all of it in {log}):\n{tail}")
    if previous and previous != image_id(IMAGE):  # the image it replaced (~1.3 GB of its own)
        argv = ["podman", "rmi", previous]
        subprocess.run(argv, env=podman_env(), capture_output=True, check=False)


def image_id(name: str) -> str | None:
    """The id of image ``name`` in podman's store, if it is there."""
    argv = ["podman", "image", "inspect", "--format", "{{.Id}}", name]
    found = subprocess.run(argv, env=podman_env(), capture_output=True, text=True, check=False)
    return found.stdout.strip() or None if found.returncode == 0 else None


@contextlib.contextmanager
def api_service(socket_path: Path) -> Iterator[str]:
    """``podman system service`` on ``socket_path`` for the block; yields its
    ``DOCKER_HOST`` URL. Stopped (SIGTERM, then SIGKILL) on the way out."""
    socket_path.unlink(missing_ok=True)
    url = f"unix://{socket_path}"
    log = open(CACHE / "podman-service.log", "w")  # noqa: SIM115 (closed below)
    service = subprocess.Popen(
        ["podman", "system", "service", "--time", "0", url],
        env=podman_env(),
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        _wait_for_api(socket_path, service)
        yield url
    finally:
        service.terminate()
        try:
            service.wait(timeout=15)
        except subprocess.TimeoutExpired:
            service.kill()
            service.wait()
        log.close()
        socket_path.unlink(missing_ok=True)


def _wait_for_api(socket_path: Path, service: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 30
    with httpx.Client(transport=httpx.HTTPTransport(uds=str(socket_path))) as client:
        while time.monotonic() < deadline:
            if service.poll() is not None:
                raise StepFailed(f"podman system service exited {service.returncode}")
            with contextlib.suppress(httpx.HTTPError):
                if client.get("http://podman/_ping", timeout=2).status_code == 200:
                    return
            time.sleep(0.2)
    raise StepFailed(f"podman's API did not answer on {socket_path} within 30 s")


@contextlib.contextmanager
def health_ticker(project: str, every: float = 5.0) -> Iterator[None]:
    """Run each running container's own health check of compose ``project`` every
    ``every`` seconds for the block. Docker's daemon does this itself; podman leaves it
    to systemd timers, which a machine without systemd lacks."""
    stop = threading.Event()

    def tick() -> None:
        label = f"label=com.docker.compose.project={project}"
        while not stop.wait(every):
            listed = subprocess.run(
                ["podman", "ps", "-q", "--filter", label, "--filter", "status=running"],
                env=podman_env(),
                capture_output=True,
                text=True,
                check=False,
            )
            for cid in listed.stdout.split():
                argv = ["podman", "healthcheck", "run", cid]
                subprocess.run(argv, env=podman_env(), capture_output=True, check=False)

    thread = threading.Thread(target=tick, name="health-ticker", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=30)


@contextlib.contextmanager
def plain_container(port: int) -> Iterator[str]:
    """The image run as is (``podman run``, its default command, no model mounted) with
    port 8000 published on ``127.0.0.1:port`` for the block; yields the container's name.
    Removed on the way out."""
    name = f"shardserve-check-defaults-{os.getpid()}"
    run(["podman", "run", "-d", "--name", name, "-p", f"127.0.0.1:{port}:8000", IMAGE], quiet=True)
    try:
        yield name
    finally:
        run(["podman", "rm", "-f", "-t", "10", name], quiet=True)


def wait_own_healthcheck(name: str, timeout: float) -> float:
    """Run the image's ``HEALTHCHECK`` in container ``name`` until it passes; seconds
    waited (``StepFailed`` if the image has none, or on timeout)."""
    inspected = run(["podman", "inspect", "--format", "{{json .Config.Healthcheck}}", name])
    if "/health" not in inspected:
        raise StepFailed(f"the image has no HEALTHCHECK on /health: {inspected}")
    began = time.monotonic()
    while time.monotonic() - began < timeout:
        argv = ["podman", "healthcheck", "run", name]
        checked = subprocess.run(argv, env=podman_env(), capture_output=True, check=False)
        if checked.returncode == 0:
            return time.monotonic() - began
        time.sleep(2)
    raise StepFailed(f"the image's HEALTHCHECK did not pass within {timeout:.0f}s")
