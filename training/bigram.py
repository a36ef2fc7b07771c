"""A count-based baseline for the biLM's perplexity: an interpolated Kneser-Ney bigram model per direction, over
the same vocabulary (<UNK> for the rest) and the same predictions (`<S> w_1 .. w_n </S>`: n + 1 words each way).

    P(w | v) = max(c(v, w) - d, 0) / c(v) + d * N1+(v, .) / c(v) * P_cont(w),
    P_cont(w) = N1+(., w) / N1+(., .)     (in how many contexts w was seen, not how often; each N1+(., w)
                                           gets +0.5 so that a word never seen after any context keeps some mass)
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from itertools import pairwise

import numpy as np

from training.vocab import BOS, EOS, Vocabulary

DISCOUNT = 0.75


class KneserNeyBigram:
    def __init__(self, vocab: Vocabulary, sentences: Iterable[Sequence[str]], discount: float = DISCOUNT):
        self.vocab, self.discount = vocab, discount
        pairs: Counter[tuple[int, int]] = Counter()
        for s in sentences:
            ids = [vocab.id(w) for w in (BOS, *s, EOS)]
            pairs.update(pairwise(ids))
        self.pairs = pairs
        n = len(vocab)
        self.context_count = np.zeros(n)  # c(v)
        self.context_types = np.zeros(n)  # N1+(v, .)
        continuation = np.zeros(n)  # N1+(., w)
        for (v, w), c in pairs.items():
            self.context_count[v] += c
            self.context_types[v] += 1
            continuation[w] += 1
        # Every word gets some mass (a vocabulary word never seen after any context would get none).
        self.p_cont = (continuation + 0.5) / (continuation + 0.5).sum()

    def prob(self, v: int, w: int) -> float:
        c_v = self.context_count[v]
        if c_v == 0:
            return float(self.p_cont[w])
        seen = max(self.pairs.get((v, w), 0) - self.discount, 0.0) / c_v
        return seen + self.discount * self.context_types[v] / c_v * float(self.p_cont[w])

    def perplexity(self, sentences: Iterable[Sequence[str]]) -> tuple[float, int]:
        nll, count = 0.0, 0
        for s in sentences:
            ids = [self.vocab.id(w) for w in (BOS, *s, EOS)]
            for v, w in pairwise(ids):
                nll -= math.log(self.prob(v, w))
                count += 1
        return math.exp(nll / count), count


def bigram_perplexity(
    vocab: Vocabulary, train: Sequence[Sequence[str]], heldout: Sequence[Sequence[str]]
) -> dict[str, float]:
    """Forward and backward (the same model trained on reversed sentences) held-out perplexity."""
    return bigram_perplexities(vocab, train, {"all": heldout})["all"]


def bigram_perplexities(
    vocab: Vocabulary, train: Sequence[Sequence[str]], heldout: dict[str, Sequence[Sequence[str]]]
) -> dict[str, dict[str, float]]:
    """bigram_perplexity for several held-out sets (one per source), each direction's model counted once."""
    forward = KneserNeyBigram(vocab, train)
    backward = KneserNeyBigram(vocab, [s[::-1] for s in train])
    return {
        name: {
            "forward": round(forward.perplexity(sentences)[0], 2),
            "backward": round(backward.perplexity([s[::-1] for s in sentences])[0], 2),
        }
        for name, sentences in heldout.items()
    }
