"""The base class allennlp 0.9's elmo_test.py expects (its ElmoTestCase), written for this project: the fixture
model's files (tests/fixtures/elmo-tiny holds allennlp's ELMo test fixtures) and their expected embeddings, in
the layout allennlp's loader returns them."""

from __future__ import annotations

import json
import unittest

import h5py
import numpy as np

from tests.conftest import TINY


class ElmoTestCase(unittest.TestCase):
    def setUp(self) -> None:
        self.elmo_fixtures_path = TINY
        self.options_file = str(TINY / "options.json")
        self.weight_file = str(TINY / "lm_weights.hdf5")
        self.sentences_json_file = str(TINY / "sentences.json")

    def _load_sentences_embeddings(self) -> tuple[list[list[str]], list[list[np.ndarray]]]:
        """(sentences, embeddings), each a list of 3 lists of 10: the k-th item of list i is sentence k of the
        TensorFlow batch i that wrote lm_embeddings_i.hdf5, its top layer as [forward; backward] (n_tokens, 32)."""
        sentences = json.loads((TINY / "sentences.json").read_text())
        embeddings = []
        for i in range(len(sentences)):
            with h5py.File(TINY / f"lm_embeddings_{i}.hdf5", "r") as f:
                embeddings.append([np.concatenate([f[str(k)][0], f[str(k)][1]], axis=-1) for k in range(10)])
        return sentences, embeddings
