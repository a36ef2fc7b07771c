"""Shared fixtures: the tiny published-layout ELMo with known answers, loaded and exported once."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

TINY = Path(__file__).resolve().parent / "fixtures" / "elmo-tiny"  # provenance and license: its README
MANYLANGS = Path(__file__).resolve().parent / "fixtures" / "elmoformanylangs-tiny"  # the same
CONFIGS = Path(__file__).resolve().parents[1] / "bench" / "configs"  # the published architectures' options
DEFAULT_MODEL = Path(__file__).resolve().parents[1] / "models" / "default"  # the embedded default model


@pytest.fixture(scope="session")
def tiny_dir() -> Path:
    return TINY


@pytest.fixture(scope="session")
def sentences(tiny_dir) -> list[list[str]]:
    return json.loads((tiny_dir / "sentences_flat.json").read_text())


@pytest.fixture(scope="session")
def expected(tiny_dir) -> list[np.ndarray]:
    """allennlp's stateless layers for each sentence, (3, n_tokens, 32)."""
    data = np.load(tiny_dir / "expected_layers.npz")
    return [data[f"s{i}"] for i in range(len(data.files))]


@pytest.fixture(scope="session")
def tiny_bilm(tiny_dir):
    from model_export.weights import load_bilm

    return load_bilm(tiny_dir / "options.json", tiny_dir / "lm_weights.hdf5")


@pytest.fixture(scope="session")
def tiny_model_dir(tiny_dir, tmp_path_factory) -> Path:
    from model_export.export import export_published

    out = tmp_path_factory.mktemp("tiny-onnx")
    export_published(tiny_dir / "options.json", tiny_dir / "lm_weights.hdf5", out)
    return out


@pytest.fixture(scope="session")
def default_model_dir(tmp_path_factory) -> Path:
    """The embedded default model (models/default/: 3 layers of 256), exported as `make serve` exports it."""
    from model_export.export import export_published

    out = tmp_path_factory.mktemp("default-onnx") / "default"
    export_published(DEFAULT_MODEL / "options.json", DEFAULT_MODEL / "weights.hdf5", out)
    return out


@pytest.fixture(scope="session")
def manylangs_model_dir(tmp_path_factory) -> Path:
    """The ELMoForManyLangs fixture (random weights in that package's layout), exported with German's Moses rules."""
    from model_export.export import export_manylangs

    out = tmp_path_factory.mktemp("manylangs-onnx") / "manylangs"
    export_manylangs(MANYLANGS, out, language="de")
    return out


@pytest.fixture(scope="session")
def engine(tiny_model_dir):
    from service.engine.session import Engine

    return Engine(tiny_model_dir, provider="cpu", intra_op_threads=2)


def max_error(got: list[np.ndarray], want: list[np.ndarray]) -> float:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape, (g.shape, w.shape)
    return max(float(np.abs(g - w).max()) for g, w in zip(got, want, strict=True))


@pytest.fixture(scope="module")
def client(server):
    """An HTTP client on the module's `server` fixture (the modules that start one define it)."""
    import httpx

    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c
