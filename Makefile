# Set-up is a virtual environment in .venv, made on first use. torch==2.13.0 is installed first and
# explicitly (a CPU build on local disk here); pip never resolves torch by itself.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp

.PHONY: install test test-all lint format serve bench bench-forward bench-engine bench-prefix bench-serve clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

lint: $(STAMP)
	$(BIN)/ruff check tokenmill tests benchmarks scripts
	$(BIN)/ruff format --check tokenmill tests benchmarks scripts
	$(BIN)/mypy tokenmill/core

format: $(STAMP)
	$(BIN)/ruff format tokenmill tests benchmarks scripts
	$(BIN)/ruff check --fix tokenmill tests benchmarks scripts

test: lint
	$(BIN)/pytest

test-all: lint
	$(BIN)/pytest -m "slow or not slow"

# The bundled demo model, models/tokenmill-demo (scripts/train_demo_models.py made it).
serve: $(STAMP)
	$(BIN)/tokenmill serve

# Every README figure: run alone (two jobs on two cores spoil both). About an hour in all.
bench: bench-forward bench-engine bench-prefix bench-serve

bench-engine: $(STAMP)
	$(BIN)/python benchmarks/engine.py --dtype float32
	$(BIN)/python benchmarks/engine.py --dtype bfloat16

bench-forward: $(STAMP)
	$(BIN)/python benchmarks/forward.py --repeats 5

bench-prefix: $(STAMP)
	$(BIN)/python benchmarks/prefix_cache.py --dtype float32
	$(BIN)/python benchmarks/prefix_cache.py --dtype bfloat16

bench-serve: $(STAMP)
	$(BIN)/python benchmarks/serve.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache
