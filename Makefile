# The documented commands. `make test` and `make serve` install what they need on first use.
VENV     ?= .venv
PYTHON   ?= python3
RUNTIME  ?= cpu            # cpu (onnxruntime) or gpu (onnxruntime-gpu); never both in one environment
TORCH    := torch==2.13.0  # first, so nothing pulls another torch (and gigabytes of CUDA packages)
BIN      := $(VENV)/bin

.PHONY: install lint format test clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet $(TORCH)
	$(BIN)/python -m pip install --quiet -e ".[$(strip $(RUNTIME)),export,dev]"
	touch $@

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: install
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

test: install lint
	$(BIN)/pytest -q

clean:
	rm -rf $(VENV) build .pytest_cache .ruff_cache
