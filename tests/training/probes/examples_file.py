"""The examples.jsonl that the probes (training.probes.senses, training.probes.syntax) read (training/corpus.py
writes WordNet's), made from rows written for a test."""

from __future__ import annotations

import json
from pathlib import Path


def write_examples(path: Path, rows) -> Path:
    """rows: (synset, lemmas, sentence, split), the sentence's tokens split on spaces."""
    lines = [
        json.dumps({"synset": s, "lemmas": lemmas, "tokens": text.split(), "split": split})
        for s, lemmas, text, split in rows
    ]
    path.write_text("\n".join(lines) + "\n")
    return path
