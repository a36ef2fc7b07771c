"""training.probes.syntax: the part-of-speech probe per layer, run on the tiny fixture model (whose weights are
allennlp's test fixture, so its figures mean nothing: the test checks the machinery) and on vectors made for the
test."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.training.probes.examples_file import write_examples
from training.probes.syntax import ambiguous_words, load_occurrences, main, probe_layers, ridge_probe, run

EXAMPLES = [  # (synset, lemmas, sentence, split): WordNet's layout in examples.jsonl
    ("n1", ["bank"], "the bank is on the corner", "train"),
    ("v1", ["bank"], "you can bank on his help", "train"),
    ("n2", ["run"], "a long run in the park", "train"),
    ("v2", ["run"], "they run to the station every day", "train"),
    ("a1", ["quick"], "a quick reply came", "train"),
    ("r1", ["quickly"], "she answered quickly", "train"),
    ("n3", ["walk"], "we took a walk after dinner", "train"),
    ("v3", ["walk"], "I walk to work", "train"),
    ("s1", ["red"], "the red door", "train"),
    ("n4", ["bank"], "he sat on the bank of the river", "heldout"),
    ("v4", ["run"], "the dogs run fast", "heldout"),
    ("n5", ["walk"], "the walk was long", "heldout"),
    ("a2", ["quick"], "quick steps were heard", "heldout"),
]


@pytest.fixture(scope="module")
def examples(tmp_path_factory):
    return write_examples(tmp_path_factory.mktemp("syntax") / "examples.jsonl", EXAMPLES)


def test_occurrences_carry_the_synsets_part_of_speech(examples):
    sentences, occurrences = load_occurrences(examples)
    assert len(sentences) == len(EXAMPLES)
    assert (0, 1, "bank", "noun", False) in occurrences and (1, 2, "bank", "verb", False) in occurrences
    assert (8, 1, "red", "adjective", False) in occurrences  # a satellite adjective is an adjective
    assert ambiguous_words(occurrences) == {"bank", "run", "walk"}


def test_ridge_probe_separates_separable_classes():
    rng = np.random.default_rng(0)
    noun, verb = np.array([1.0, 0, 0]), np.array([0, 1.0, 0])
    x = np.concatenate([rng.normal(0, 0.1, (20, 3)) + noun, rng.normal(0, 0.1, (20, 3)) + verb])
    y = ["noun"] * 20 + ["verb"] * 20
    assert ridge_probe(x, y, np.array([[1.0, 0, 0], [0, 1.0, 0]])) == ["noun", "verb"]


def test_layer_zero_gives_every_occurrence_of_a_word_one_answer(examples):
    """Context-free vectors: identical per word, so the probe cannot be right on both uses of an ambiguous word;
    vectors that carry the part of speech (a contextual layer made for the test) get it right."""
    sentences, occurrences = load_occurrences(examples)
    rng = np.random.default_rng(1)
    word_vectors = {w: rng.normal(size=8) for w in {t for s in sentences for t in s}}
    pos_vectors = {p: rng.normal(size=8) * 5 for p in ("noun", "verb", "adjective", "adverb")}
    layers = {}
    for i, s in enumerate(sentences):
        layers[i] = np.zeros((2, len(s), 8))
        layers[i][0] = [word_vectors[t] for t in s]
        layers[i][1] = layers[i][0]
    for i, j, _, pos, _ in occurrences:
        layers[i][1, j] = word_vectors[sentences[i][j]] + pos_vectors[pos]
    rows = probe_layers(layers, occurrences)
    assert [r["layer"] for r in rows] == ["0", "1", "mean of 1..1"]
    assert rows[1]["accuracy"] == 1.0 and rows[1]["ambiguous_accuracy"] == 1.0
    assert rows[0]["ambiguous_accuracy"] <= rows[1]["ambiguous_accuracy"]
    assert rows[0]["test"] == 4 and rows[0]["ambiguous"] == 3 and 0 <= rows[0]["majority"] <= 1


def test_probe_runs_on_an_exported_model(tiny_model_dir, examples, tmp_path, capsys):
    rows = run(tiny_model_dir, examples)
    assert [r["layer"] for r in rows] == ["0", "1", "2", "mean of 1..2"]
    for r in rows:
        assert 0 <= r["accuracy"] <= 1 and 0 <= r["ambiguous_accuracy"] <= 1
    main(["--model", str(tiny_model_dir), "--examples", str(examples), "--json", str(tmp_path / "rows.json")])
    printed = capsys.readouterr().out
    assert "| layer | part-of-speech accuracy |" in printed and "| mean of 1..2 |" in printed
    assert json.loads((tmp_path / "rows.json").read_text()) == rows
