"""The count baseline (training.bigram): an interpolated Kneser-Ney bigram model."""

from __future__ import annotations

import math

import pytest

from training.bigram import KneserNeyBigram
from training.vocab import Vocabulary


def test_kneser_ney_bigram_is_a_distribution():
    vocab = Vocabulary(["</S>", "<S>", "<UNK>", "a", "b", "c"])
    model = KneserNeyBigram(vocab, [["a", "b"], ["a", "c", "x"], ["b", "b", "a"]])
    for v in range(len(vocab)):
        assert sum(model.prob(v, w) for w in range(len(vocab))) == pytest.approx(1.0)
    ppl, count = model.perplexity([["a", "b"]])
    assert count == 3 and 1 < ppl < len(vocab)
    assert math.isclose(
        ppl, math.exp(-(math.log(model.prob(1, 3)) + math.log(model.prob(3, 4)) + math.log(model.prob(4, 0))) / 3)
    )
