# Two commands do all set-up on a fresh machine: `make test` and `make demo`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: all setup test test-fast demo bench clean

all: test

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

$(STAMP): $(PY) pyproject.toml requirements-dev.txt
	$(PY) -m pip install -q -r requirements-dev.txt
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

setup: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider $(PYTEST_ARGS)

test-fast: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider -m "not slow" $(PYTEST_ARGS)

demo: $(STAMP)
	$(VENV)/bin/spotguard demo

bench: $(STAMP)
	$(PY) -m benchmarks $(BENCH_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis .demo build dist *.egg-info
