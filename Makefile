# astrai: every target installs what it needs first, so a fresh clone needs no manual step.
PYTHON_BOOTSTRAP ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# PyTorch goes in first, pinned: on a CPU-only machine this resolves to a local CPU build,
# so the dependencies below never pull a multi-GB CUDA build.
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.astrai-installed
PYTEST_ARGS ?=

.PHONY: setup test train serve bench lint format clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	@test -x $(PY) || $(PYTHON_BOOTSTRAP) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet "$(TORCH_SPEC)"
	$(PIP) install --quiet -e ".[dev]"
	@touch $(STAMP)

test: setup
	WANDB_MODE=offline $(PY) -m pytest $(PYTEST_ARGS)

train: setup
	$(PY) -m astrai.train $(ARGS)

serve: setup
	$(PY) -m astrai.serve $(ARGS)

bench: setup
	$(PY) -m astrai.bench $(ARGS)

lint: setup
	$(PY) -m ruff format --check astrai tests
	$(PY) -m ruff check astrai tests

format: setup
	$(PY) -m ruff format astrai tests
	$(PY) -m ruff check --fix astrai tests

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
