"""The toy language the training tests train on: structure a model learns in seconds."""

from __future__ import annotations

from pathlib import Path

import numpy as np

WORDS = [
    "the",
    "a",
    "cat",
    "dog",
    "sat",
    "ran",
    "on",
    "under",
    "mat",
    "rug",
    "red",
    "big",
    "small",
    "quickly",
    "slowly",
]


def write_corpus(path: Path, lines: int, seed: int) -> Path:
    """A toy language with structure: determiner adjective? noun verb adverb? preposition determiner noun."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(lines):
        s = [rng.choice(["the", "a"])]
        if rng.random() < 0.5:
            s.append(rng.choice(["red", "big", "small"]))
        s += [rng.choice(["cat", "dog"]), rng.choice(["sat", "ran"])]
        if rng.random() < 0.3:
            s.append(rng.choice(["quickly", "slowly"]))
        s += [rng.choice(["on", "under"]), rng.choice(["the", "a"]), rng.choice(["mat", "rug"])]
        out.append(" ".join(s))
    path.write_text("\n".join(out) + "\n")
    return path
