"""The toy corpus and one model trained on it, shared by the training tests of a module."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.training.toy import write_corpus
from training.trainer import train


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("corpus") / "toy.txt", 1200, seed=0)


@pytest.fixture(scope="module")
def trained(corpus, tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("trained")
    return out, train([corpus], out, "tiny", epochs=3)
