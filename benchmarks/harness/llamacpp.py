"""llama.cpp as a benchmark peer: its sources, its two binaries, and ``llama-server``'s command.

The sources are the llama.cpp tree vendored in the ``llama-cpp-python`` sdist
(``pip download --no-binary :all:``, the registry only), unpacked under
``benchmarks/.cache/llamacpp``. :func:`ensure_binaries` configures it with cmake once (a
native CPU build less AMX, no curl, tests, examples or web UI) and builds only ``llama-server`` and
``llama-quantize``; later calls find the binaries built by the same configure command (the
stamp file beside them) and return at once. Each step that ran is
timed into the ``log`` list it is given (the run's notes).
"""

from __future__ import annotations

import subprocess
import sys
import tarfile
import time
from pathlib import Path

from benchmarks.harness.paths import CACHE

VERSION = "0.3.36"  # llama-cpp-python; its vendor/llama.cpp is the peer
ROOT = CACHE / "llamacpp"
SOURCES = ROOT / f"llama_cpp_python-{VERSION}" / "vendor" / "llama.cpp"
BUILD = ROOT / "build"
STAMP = BUILD / "shardserve-build.txt"  # the configure command the binaries were built with
TARGETS = ("llama-server", "llama-quantize")
CMAKE = "/usr/bin/cmake"
JOBS = 2
# ggml's AMX matmul (compiled in by -march=native on a CPU with AMX) segfaults on the first
# decode on our Xeon VMs, though the kernel grants the tile permission; GCC keeps an explicit
# -mno-* over what -march=native implies, so everything else stays native.
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=ON",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",  # else the build fetches the web UI from Hugging Face
    "-DBUILD_SHARED_LIBS=OFF",  # self-contained binaries
    f"-DCMAKE_C_FLAGS={NO_AMX}",
    f"-DCMAKE_CXX_FLAGS={NO_AMX}",
)
SERVER_THREADS = 2  # the machine's cores, what shardserve's CPU budget gives its one rank
SLOT_TOKENS = 256  # context per slot: a 32-token prompt and 64 outputs, with room


def binary(name: str) -> Path:
    return BUILD / "bin" / name


def download_command(dest: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-binary",
        ":all:",
        "--no-deps",
        "-q",
        "-d",
        str(dest),
        f"llama-cpp-python=={VERSION}",
    ]


def configure_command() -> list[str]:
    return [CMAKE, "-S", str(SOURCES), "-B", str(BUILD), *CMAKE_FLAGS]


def build_command() -> list[str]:
    return [CMAKE, "--build", str(BUILD), "-j", str(JOBS), "--target", *TARGETS]


def _timed(log: list[str], what: str, command: list[str], output: Path) -> None:
    """Run ``command`` with its output in ``output``; its wall time into ``log``."""
    start = time.monotonic()
    with output.open("wb") as sink:
        done = subprocess.run(command, stdout=sink, stderr=subprocess.STDOUT, check=False)
    if done.returncode != 0:
        tail = output.read_text(errors="replace")[-2000:]
        raise RuntimeError(f"llama.cpp {what} failed ({done.returncode}), see {output}:\n{tail}")
    log.append(f"llama.cpp {what}: {time.monotonic() - start:.0f} s")


def ensure_sources(log: list[str]) -> Path:
    """The vendored llama.cpp tree, downloaded and unpacked on first use."""
    if (SOURCES / "CMakeLists.txt").is_file():
        return SOURCES
    ROOT.mkdir(parents=True, exist_ok=True)
    sdist = ROOT / f"llama_cpp_python-{VERSION}.tar.gz"
    if not sdist.is_file():
        _timed(log, f"sdist download ({sdist.name})", download_command(ROOT), ROOT / "pip.log")
    with tarfile.open(sdist) as archive:
        archive.extractall(ROOT, filter="data")
    if not (SOURCES / "CMakeLists.txt").is_file():
        raise RuntimeError(f"{sdist.name} has no vendor/llama.cpp")
    return SOURCES


def ensure_binaries(log: list[str]) -> dict[str, Path]:
    """``llama-server`` and ``llama-quantize`` by name, built on first use (minutes)."""
    paths = {name: binary(name) for name in TARGETS}
    stamp = " ".join(configure_command())
    built = STAMP.is_file() and STAMP.read_text() == stamp
    if built and all(path.is_file() for path in paths.values()):
        return paths
    ensure_sources(log)
    BUILD.mkdir(parents=True, exist_ok=True)
    STAMP.unlink(missing_ok=True)
    _timed(log, "cmake configure", configure_command(), BUILD / "configure.log")
    _timed(
        log, f"build of {' and '.join(TARGETS)} (-j{JOBS})", build_command(), BUILD / "build.log"
    )
    STAMP.write_text(stamp)
    return paths


def server_command(server: Path, gguf: Path, port: int, parallel: int) -> list[str]:
    """``llama-server`` on ``gguf`` with the CPU budget shardserve has: ``SERVER_THREADS``
    threads for decode and for prompt batches, ``parallel`` slots of ``SLOT_TOKENS`` each,
    continuous batching. ``--cache-ram 0``: no host-memory prompt cache (fresh prompts never
    hit it; it would only grow the peak RSS). ``--poll 0``: idle worker threads sleep instead
    of spinning for the next graph; with the default spin, sharing 2 cores with the load
    generator, it measured 5-13 tok/s at c=1 and ran into the 60 s cap at c=32, against
    80-98 and ~250 with ``--poll 0`` minutes later (a later flag, e.g. ``--poll 50``, wins)."""
    return [
        str(server),
        "--model",
        str(gguf),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--threads",
        str(SERVER_THREADS),
        "--threads-batch",
        str(SERVER_THREADS),
        "--parallel",
        str(parallel),
        "--ctx-size",
        str(parallel * SLOT_TOKENS),
        "--cont-batching",
        "--cache-ram",
        "0",
        "--poll",
        "0",
        "--no-webui",
    ]
