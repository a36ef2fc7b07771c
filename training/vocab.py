"""The language model's output vocabulary, in bilm-tf's `vocab.txt` layout: one token per line, most frequent
first after the three special tokens. Inputs need no vocabulary (the char-CNN reads any word); only the softmax
predicts from this list, and every other word is predicted as the unknown-word class <UNK>."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from pathlib import Path

BOS, EOS, UNK = "<S>", "</S>", "<UNK>"
SPECIALS = (EOS, BOS, UNK)  # bilm-tf's order


class Vocabulary:
    def __init__(self, words: Iterable[str]):
        self.words = list(words)
        if tuple(self.words[:3]) != SPECIALS:
            raise ValueError(f"a vocabulary starts with {', '.join(SPECIALS)}")
        self.index = {w: i for i, w in enumerate(self.words)}
        if len(self.index) != len(self.words):
            raise ValueError("a vocabulary lists each word once")
        self.unk = self.index[UNK]

    def __len__(self) -> int:
        return len(self.words)

    def id(self, word: str) -> int:
        return self.index.get(word, self.unk)

    @classmethod
    def build(cls, sentences: Iterable[list[str]], max_size: int, min_count: int = 1) -> Vocabulary:
        """The max_size - 3 most frequent words seen at least min_count times (ties broken alphabetically)."""
        counts = Counter(w for s in sentences for w in s)
        for special in SPECIALS:
            counts.pop(special, None)
        ranked = sorted((w for w, n in counts.items() if n >= min_count), key=lambda w: (-counts[w], w))
        return cls([*SPECIALS, *ranked[: max_size - len(SPECIALS)]])

    def save(self, path: str | Path) -> None:
        Path(path).write_text("\n".join(self.words) + "\n", encoding="utf-8")

    @classmethod
    def load(cls, path: str | Path) -> Vocabulary:
        return cls(Path(path).read_text(encoding="utf-8").splitlines())
