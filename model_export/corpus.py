"""The training corpus of the default model: WordNet 3.0's glosses and usage examples, as plain text.

WordNet (Debian package `wordnet-base`, /usr/share/wordnet, WordNet 3.0 license: use, copy and distribute with its
notice) has about 117k synsets; each gloss is a definition and often usage examples in quotes, many of them showing
one word in several senses, which is what a contextual model has to tell apart:

    02787772 06 n 01 bank 0 ... | a building in which the business of banking transacted; "the bank is on the corner"

becomes two lines, `a building in which the business of banking transacted` and `the bank is on the corner`,
tokenized with the service's Moses tokenizer (so training and serving split text alike), one sentence per line.
Every 50th synset (by a hash of its offset, so the split never changes) goes to the held-out file, whole.

    python -m model_export.corpus --out build/corpus   # -> train.txt, heldout.txt, examples.jsonl
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from service.tokenize import tokenize

WORDNET_DIR = Path("/usr/share/wordnet")
PARTS_OF_SPEECH = ("noun", "verb", "adj", "adv")
HELDOUT_EVERY = 50
_QUOTED = re.compile(r'"([^"]*)"')


@dataclass(frozen=True)
class Synset:
    key: str  # part of speech and offset, e.g. "n02787772"
    lemmas: tuple[str, ...]  # with spaces for underscores: "perk up"
    definitions: tuple[str, ...]
    examples: tuple[str, ...]

    @property
    def heldout(self) -> bool:
        return zlib.crc32(self.key.encode()) % HELDOUT_EVERY == 0


def parse_data_line(line: str, pos: str) -> Synset | None:
    """One line of a WordNet `data.*` file; None for the license header."""
    if line.startswith("  ") or " | " not in line:
        return None
    head, gloss = line.split(" | ", 1)
    fields = head.split()
    n_words = int(fields[3], 16)
    lemmas = tuple(re.sub(r"\(.*\)$", "", w).replace("_", " ") for w in fields[4 : 4 + 2 * n_words : 2])
    examples = tuple(e.strip() for e in _QUOTED.findall(gloss) if e.strip())
    rest = _QUOTED.sub("", gloss)
    definitions = tuple(d.strip() for d in rest.split(";") if d.strip() and re.search(r"\w", d))
    return Synset(pos[0] + fields[0], lemmas, definitions, examples)


def read_wordnet(wordnet_dir: Path = WORDNET_DIR) -> Iterator[Synset]:
    for pos in PARTS_OF_SPEECH:
        path = wordnet_dir / f"data.{pos}"
        if not path.exists():
            raise FileNotFoundError(f"{path} not found: install the Debian package wordnet-base")
        with path.open(encoding="utf-8", errors="replace") as f:
            for line in f:
                synset = parse_data_line(line.rstrip("\n"), pos)
                if synset is not None:
                    yield synset


def build_corpus(out_dir: Path, wordnet_dir: Path = WORDNET_DIR) -> dict[str, int]:
    """Write train.txt and heldout.txt (one tokenized sentence per line) and examples.jsonl (every usage
    example with its synset and lemmas, for the word-sense evaluation); returns line and token counts."""
    out_dir.mkdir(parents=True, exist_ok=True)
    counts = {"synsets": 0, "train_lines": 0, "train_tokens": 0, "heldout_lines": 0, "heldout_tokens": 0}
    with (
        (out_dir / "train.txt").open("w") as train,
        (out_dir / "heldout.txt").open("w") as heldout,
        (out_dir / "examples.jsonl").open("w") as examples,
    ):
        for synset in read_wordnet(wordnet_dir):
            counts["synsets"] += 1
            split, out = ("heldout", heldout) if synset.heldout else ("train", train)
            for text in synset.definitions + synset.examples:
                tokens = tokenize(text)
                if tokens:
                    out.write(" ".join(tokens) + "\n")
                    counts[f"{split}_lines"] += 1
                    counts[f"{split}_tokens"] += len(tokens)
            for text in synset.examples:
                record = {"synset": synset.key, "lemmas": synset.lemmas, "tokens": tokenize(text), "split": split}
                examples.write(json.dumps(record) + "\n")
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Build the WordNet gloss corpus (train.txt, heldout.txt).")
    parser.add_argument("--out", default="build/corpus", type=Path)
    parser.add_argument("--wordnet", default=WORDNET_DIR, type=Path, help="folder of WordNet's data.* files")
    args = parser.parse_args(argv)
    try:
        counts = build_corpus(args.out, args.wordnet)
    except FileNotFoundError as err:
        print(f"corpus: {err}", file=sys.stderr)
        return 1
    print(json.dumps(counts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
