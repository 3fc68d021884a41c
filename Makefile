# Entry points on a fresh machine: `make demo`, `make check` (after every change) and `make test`
# (the whole suite, what CI runs). Each creates .venv when missing.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

# Exact pins for a CPU-only machine (README, "Install"; docs/design.md, "Installing").
# torch is its CPU build (+cpu: PyPI's torch==2.13.0 is a multi-GB CUDA build). That build
# requires no triton, and embcache's kernels need one (its interpreter runs them on a CPU):
# triton 3.7.1 is the one torch 2.13.0 is built against (PyPI's CUDA build requires exactly it),
# so the same pins resolve with either build. fbgemm-gpu-cpu 1.8.0 and torchrec 1.8.0 are built
# against torch 2.13: pyproject.toml's [torchrec] extra pins torch==2.13.* and fbgemm-gpu-cpu,
# and torchrec goes in last with --no-deps (its declared deps pull the CUDA fbgemm-gpu).
# tests/test_pins.py runs pip's resolver over exactly these (`make -s install-args`).
TORCH_PIN := torch==2.13.0+cpu
TRITON_PIN := triton==3.7.1
NODEPS_PINS := torchrec==1.8.0
# Where torch's CPU build comes from: pip's own sources when they hold it (a local wheel
# directory, as on these machines: `pip config list`), otherwise PyTorch's CPU wheel index.
TORCH_CPU_INDEX := https://download.pytorch.org/whl/cpu
PIP = $(BIN)/python -m pip
TORCH_SOURCE = $$($(PIP) install -q --dry-run --no-deps --ignore-installed '$(TORCH_PIN)' \
	>/dev/null 2>&1 || echo --extra-index-url $(TORCH_CPU_INDEX))
# Every optional part, so that `make test` and `make demo` have everything (pyproject.toml).
EXTRAS := dev,cpu,metrics,torchrec,redis,plots
# The packages `make lint` type-checks (mypy, configured in pyproject.toml); one joins the list
# once it is clean.
TYPED := embcache/backend.py embcache/indexing.py embcache/ops embcache/kv embcache/kernels embcache/cache \
	embcache/checkpoint embcache/engine embcache/optim embcache/models

.PHONY: venv check test demo bench lint format clean install-args

venv: $(STAMP)

# torchrec goes in last, with --no-deps and --no-warn-conflicts: it declares fbgemm-gpu (the CUDA
# build; fbgemm-gpu-cpu provides the same modules) and torchmetrics==1.0.3 (it runs with the
# newer one the extras install), so pip's check after any install that touches it prints a red
# "ERROR: pip's dependency resolver ... torchrec 1.8.0 requires fbgemm-gpu" although nothing failed.
$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q $(TORCH_SOURCE) $(TORCH_PIN) $(TRITON_PIN) -e '.[$(EXTRAS)]'
	$(PIP) install -q --no-deps --no-warn-conflicts $(NODEPS_PINS)
	touch $(STAMP)

# The first install's arguments on one line, the --no-deps install's on the next; PIP=... names
# the pip that decides where torch comes from (tests/test_pins.py).
install-args:
	@echo $(TORCH_SOURCE) $(TORCH_PIN) $(TRITON_PIN) -e '.[$(EXTRAS)]'
	@echo $(NODEPS_PINS)

# Both run pytest on two pytest-xdist workers: one process keeps about one core busy (Triton's
# interpreter is single-threaded; much of `make test` waits on ranks, servers and CLI runs).
# --dist loadfile keeps each file's tests in order in one worker, so a module-scoped fixture
# (ranks, a redis-server, the README's clone) starts once. Without -n, pytest runs in one
# process: `.venv/bin/python -m pytest -q tests/test_cli.py` runs one file, in order.
XDIST := -n 2 --dist loadfile

# The check to run after every change, about 2.5 minutes on 2 cores (3.5 without -n): lint, then
# the in-process tests, each test function's first case per backend (EMBCACHE_TEST_SUBSET). Left
# to `make test`: the tests marked `integration` (tests/conftest.py marks every test that starts a
# process or a server) or `slow`.
check: lint
	EMBCACHE_TEST_SUBSET=first-per-function $(BIN)/python -m pytest -q --disable-warnings \
		-m "not integration and not slow" $(XDIST)

# The whole suite, what CI runs: about 13 minutes on 2 cores (16 without -n).
test: $(STAMP)
	$(BIN)/python -m pytest -q $(XDIST)

demo: $(STAMP)
	$(BIN)/embcache train

bench: $(STAMP)
	$(BIN)/embcache bench

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy $(TYPED)

format: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache build *.egg-info

# The GPU check rehearsed on this CPU: benchmarks/gpu_check.sh --rehearsal in a Python built like
# the GPU image's, once, under ~/.cache/embcache/gpu-image-py3.12 (tests/gpu_image/build.sh:
# Python 3.12, torch 2.11.0+cu130, triton 3.6.0; ~5 GB, 1-3 minutes the first time).
# gpu-rehearsal: every step and every test the GPU check runs, Triton in its interpreter; run it
# after changing kernels or their tests, and before a first run on a new GPU machine
# (docs/gpu-check.md). gpu-rehearsal-ci: the same steps, every kernel test collected, the first of
# each test function run per backend (.ci/run).
.PHONY: gpu-image gpu-rehearsal gpu-rehearsal-ci

gpu-image:
	bash tests/gpu_image/build.sh

gpu-rehearsal:
	PY="$$(bash tests/gpu_image/build.sh)" && PY="$$PY" bash benchmarks/gpu_check.sh --rehearsal

gpu-rehearsal-ci:
	PY="$$(bash tests/gpu_image/build.sh)" && PY="$$PY" bash benchmarks/gpu_check.sh --rehearsal --subset
