# The documented commands. `make test` and `make serve` install what they need on first use.
VENV     ?= .venv
PYTHON   ?= python3
RUNTIME  ?= cpu            # cpu (onnxruntime) or gpu (onnxruntime-gpu); never both in one environment
TORCH    := torch==2.13.0  # first, so nothing pulls another torch (and gigabytes of CUDA packages)
BIN      := $(VENV)/bin

DEFAULT_MODEL := build/models/default

.PHONY: install lint format test serve clean

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

# Export the embedded default model once (again when its files change), then serve it on 127.0.0.1:8000.
$(DEFAULT_MODEL)/manifest.json: models/default/options.json models/default/weights.hdf5 | install
	$(BIN)/elmo-export --options models/default/options.json --weights models/default/weights.hdf5 --out $(DEFAULT_MODEL)

serve: install $(DEFAULT_MODEL)/manifest.json
	$(BIN)/elmo-serve --model $(DEFAULT_MODEL)

clean:
	rm -rf $(VENV) build .pytest_cache .ruff_cache
