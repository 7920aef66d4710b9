# Two entry points, each working on a fresh machine with Python 3.11+ and pip:
#   make demo   creates .venv, trains the tiny model on the embedded corpus (~5 min on 2 CPU cores),
#               prints validation bits-per-byte and a generated sample
#   make test   creates .venv with the dev extras and runs the test suite
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
WORKDIR ?= runs/tiny
PYTEST_WORKERS ?= 2
# The converter test runs the official RWKV code, which needs torch: install a CPU build first so the `convert`
# extra (torch>=2.4) is already satisfied and never pulls the multi-GB CUDA wheels. The pinned CPU wheel comes from a
# local wheelhouse when pip has one, else from PyTorch's CPU index.
TORCH_CPU ?= torch==2.13.0+cpu
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu

.PHONY: demo test clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q -e .
	touch $@

$(VENV)/.installed-dev: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q '$(TORCH_CPU)' || $(BIN)/python -m pip install -q torch --index-url $(TORCH_CPU_INDEX)
	$(BIN)/python -m pip install -q -e '.[dev,convert]'
	touch $@ $(VENV)/.installed

demo: $(VENV)/.installed
	$(BIN)/ltm train --config configs/tiny.py --workdir $(WORKDIR)
	$(BIN)/ltm eval --workdir $(WORKDIR)
	$(BIN)/ltm generate --workdir $(WORKDIR) --prompt "The list" --max-new-tokens 300 --temperature 0.8 --top-p 0.95

test: $(VENV)/.installed-dev
	$(BIN)/python -m pytest -q -n $(PYTEST_WORKERS) --durations=15

clean:
	rm -rf $(VENV) runs
