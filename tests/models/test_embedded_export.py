"""The embedded default model's export that the package ships (service/embedded/default/, package data) is what
exporting models/default/ gives now: the same sources, graph version and graphs, the same numbers within 1e-5 on
every graph, and small enough to keep in git and in a wheel. Replacing the model is: train, copy the result to
models/default/, `make default-export`, commit; after a GRAPH_VERSION bump, `make default-export` alone."""

import json
from pathlib import Path

import numpy as np

from model_export.export import CHECK_SENTENCES
from service.engine.canary import CANARIES_FILE, max_abs_error
from service.engine.session import Engine
from service.manifest import GRAPH_VERSION, MANIFEST
from service.settings import DEFAULT_MODEL_DIR, Settings

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ROOT / "service" / "embedded" / "default"
AGAIN = "the shipped export is stale: run `make default-export` and commit service/embedded/default/"
# The four graphs of the default model and its canaries: about 32 MiB (a full-size ELMo would be ~935 MB, which
# belongs in an image or on a volume, never in git).
BUDGET_BYTES = 40 << 20


def manifest(folder: Path) -> dict:
    return json.loads((folder / MANIFEST).read_text())


def test_the_package_finds_the_shipped_export_as_its_default():
    assert DEFAULT_MODEL_DIR == SHIPPED  # through importlib.resources: here the working tree's package
    assert Settings().models == [("default", SHIPPED)]


def test_the_shipped_export_is_small_and_complete():
    shipped = manifest(SHIPPED)
    files = {p.name: p.stat().st_size for p in SHIPPED.iterdir()}
    assert set(files) == {MANIFEST, CANARIES_FILE, "MODEL_CARD.md", *(g["file"] for g in shipped["graphs"])}, files
    assert sum(files.values()) <= BUDGET_BYTES, files
    # the training data's licence notice (WordNet's) travels with the weights made from it
    assert (SHIPPED / "MODEL_CARD.md").read_text() == (ROOT / "models" / "default" / "MODEL_CARD.md").read_text()


def test_the_shipped_export_is_models_default_exported_now(default_model_dir):
    shipped, fresh = manifest(SHIPPED), manifest(default_model_dir)
    assert shipped["graph_version"] == fresh["graph_version"] == GRAPH_VERSION, AGAIN
    assert shipped["sources"] == fresh["sources"], AGAIN  # the same options.json and weights.hdf5 (sha256)
    same = ("format_version", "architecture", "num_layers", "output_dim", "initial_state", "token_mapping", "tokenizer")
    assert {k: shipped[k] for k in same} == {k: fresh[k] for k in same}, AGAIN
    kinds = [(g["file"], g["kind"], g["precision"], g["window"]) for g in fresh["graphs"]]
    assert [(g["file"], g["kind"], g["precision"], g["window"]) for g in shipped["graphs"]] == kinds, AGAIN
    assert shipped["canaries"]["sentences"] == fresh["canaries"]["sentences"], AGAIN
    assert fresh["canaries"]["sentences"][: len(CHECK_SENTENCES)] == CHECK_SENTENCES  # and the byte canary after
    assert set(shipped.get("files", {})) == set(fresh["files"]), AGAIN  # each file's sha256, checked at start-up
    with np.load(SHIPPED / CANARIES_FILE) as a, np.load(default_model_dir / CANARIES_FILE) as b:
        assert sorted(a.files) == sorted(b.files)
        assert max_abs_error([a[k] for k in sorted(a.files)], [b[k] for k in sorted(b.files)]) <= 1e-5, AGAIN


def test_every_shipped_graph_computes_what_a_fresh_export_does(default_model_dir):
    # Each graph of both exports on this CPU, the canary sentences through it: within 1e-5 (reduced precision too:
    # the same graph gives the same numbers; another one would show its own rounding).
    for graph in manifest(default_model_dir)["graphs"]:
        kind, precision = graph["kind"], graph["precision"]
        got = Engine(SHIPPED, provider="cpu", graph=kind, precision=precision, intra_op_threads=1)
        want = Engine(default_model_dir, provider="cpu", graph=kind, precision=precision, intra_op_threads=1)
        error = max_abs_error(got.run(CHECK_SENTENCES), want.run(CHECK_SENTENCES))
        assert error <= 1e-5, f"{graph['file']}: max abs error {error:.3g} between shipped and fresh; {AGAIN}"
