"""training.probes.senses: the 1-NN same-sense accuracy per layer, on vectors made for the test and on the tiny
fixture model (whose weights are allennlp's test fixture, so its figures mean nothing: the test checks the
machinery)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.training.probes.examples_file import write_examples
from training.probes.senses import load_occurrences, main, nearest_neighbour_accuracy, nearest_neighbour_outcomes, run

EXAMPLES = [  # (synset, lemmas, sentence, split): WordNet's layout in examples.jsonl
    ("n1", ["bank"], "the bank lent him money", "train"),
    ("n1", ["bank"], "the bank raised its rates", "train"),
    ("n2", ["bank"], "they sat on the bank of the river", "train"),
    ("n2", ["bank"], "the river overflowed its bank", "heldout"),
    ("n2", ["bank"], "a grassy bank by the stream", "heldout"),
    ("v1", ["run"], "they run every morning", "train"),
    ("v2", ["run"], "she will run the company", "train"),
    ("v2", ["run"], "he runs and they run the shop", "train"),
    ("n3", ["cat"], "the cat slept", "train"),  # one synset only: no query
]


@pytest.fixture(scope="module")
def examples(tmp_path_factory):
    return write_examples(tmp_path_factory.mktemp("senses") / "examples.jsonl", EXAMPLES)


def test_outcomes_are_the_accuracy_query_by_query(examples):
    _, occurrences = load_occurrences(examples)
    assert {o[2] for o in occurrences} == {"bank", "run"}
    words, senses = [o[2] for o in occurrences], [o[3] for o in occurrences]
    sense_vector = {s: np.random.default_rng(i).normal(size=4) for i, s in enumerate(sorted(set(senses)))}
    vectors = np.stack([sense_vector[s] for s in senses])  # a layer that knows the sense: every query right
    out = nearest_neighbour_outcomes(vectors, words, senses, np.random.default_rng(0))
    assert out["hit"] == [1] * len(out["hit"]) and len(out["query"]) == len(out["chance"])
    same_word = np.stack([sense_vector["n1"] for _ in senses])  # all alike: chance, ties broken at random
    accuracy, chance, n = nearest_neighbour_accuracy(same_word, words, senses, np.random.default_rng(0))
    out = nearest_neighbour_outcomes(same_word, words, senses, np.random.default_rng(0))
    assert (accuracy, chance, n) == (np.mean(out["hit"]), np.mean(out["chance"]), len(out["hit"]))


def test_json_and_per_query_outcomes_on_an_exported_model(tiny_model_dir, examples, tmp_path, capsys):
    summary, outcomes = run(tiny_model_dir, examples, threads=1, tie_seeds=3)
    rows = summary["rows"]
    assert [r["layer"] for r in rows] == ["0", "1", "2", "mean of 1..2"]
    for r in rows:
        hits = outcomes["layers"][r["layer"]]
        assert r["accuracy"] == np.mean(hits["all"]["hit"]) and r["heldout_accuracy"] == np.mean(hits["heldout"]["hit"])
        assert r["queries"] == len(hits["all"]["hit"]) and r["tie_break"]["seeds"] == 3
    assert rows[0]["heldout_queries"] == 2  # the two held-out bank (river) sentences, each the other's peer
    main(["--model", str(tiny_model_dir), "--examples", str(examples), "--json", str(tmp_path / "senses.json")])
    printed = capsys.readouterr().out
    assert "| layer | 1-NN same-sense accuracy |" in printed and "| mean of 1..2 |" in printed
    written = json.loads((tmp_path / "senses.json").read_text())
    assert [r["accuracy"] for r in written["rows"]] == [r["accuracy"] for r in rows]
