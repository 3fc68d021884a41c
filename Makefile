# Two entry points on a fresh machine: `make demo` and `make test`. Both create .venv when missing.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

# Exact pins that work on a CPU-only machine (docs/design.md, "Installing"). torchrec and fbgemm-gpu-cpu
# go in with --no-deps: their declared deps would pull the CUDA builds of torch and fbgemm-gpu.
TORCH_PIN := torch==2.13.0
TRITON_PIN := triton==3.8.0
NODEPS_PINS := fbgemm-gpu-cpu==1.8.0 torchrec==1.8.0

.PHONY: venv test test-fast demo bench lint format clean

venv: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(TORCH_PIN) $(TRITON_PIN)
	$(BIN)/pip install -q --no-deps $(NODEPS_PINS)
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest -q

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow"

demo: $(STAMP)
	$(BIN)/embcache train

bench: $(STAMP)
	$(BIN)/embcache bench

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
