"""The training corpus of the default model: WordNet 3.0's glosses and usage examples, as plain text.

WordNet (Debian package `wordnet-base`, /usr/share/wordnet, WordNet 3.0 license: use, copy and distribute with its
notice) has about 117k synsets; each gloss is a definition and often usage examples in quotes, many of them showing
one word in several senses, which is what a contextual model has to tell apart:

    02787772 06 n 01 bank 0 ... | a building in which the business of banking transacted; "the bank is on the corner"

becomes two lines, `a building in which the business of banking transacted` and `the bank is on the corner`,
tokenized with the service's Moses tokenizer (so training and serving split text alike), one sentence per line.
Every 50th synset (by a hash of its offset, so the split never changes) goes to the held-out file, whole.

    python -m training.corpus --out build/corpus   # -> train.txt, heldout.txt, examples.jsonl

With `--sources`, it builds the larger corpus from several installable sources (`training/texts.py`):

    python -m training.corpus --sources all --out build/corpus-all
    # -> train/<source>.txt, heldout/<source>.txt, examples.jsonl, manifest.json

each source's text cut into sentences, tokenized the same way, deduplicated across all sources (the first
occurrence in source order is kept, so no held-out sentence is also a training sentence), with a fixed held-out
split per source (every 50th unit, by a hash of its key: a WordNet synset as above, a dictionary entry, a Bible
chapter, a documentation file), and a manifest of sources, licences, package versions, counts and sha256.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import subprocess
import sys
import zlib
from pathlib import Path

from service.text.moses import tokenize
from training.texts import SOURCES, WORDNET_DIR, Source, read_wordnet, split_sentences

HELDOUT_EVERY = 50


def source_heldout(source: str, key: str) -> bool:
    """Whether a unit goes to the held-out side: every 50th key by its crc32. A WordNet synset's key goes in
    alone, without the source's name, so that the WordNet corpus and the corpus of several sources hold out the
    same synsets."""
    label = key if source == "wordnet" else f"{source}:{key}"
    return zlib.crc32(label.encode()) % HELDOUT_EVERY == 0


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
            split, out = ("heldout", heldout) if source_heldout("wordnet", synset.key) else ("train", train)
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


# -- the corpus of several sources

MIN_TOKENS = 3  # shorter lines are headings and fragments
MAX_TOKENS = 150  # longer ones are lists and run-on tables
_WORDLIKE = re.compile(r"[A-Za-z]+|'[A-Za-z]+|[.,;:!?()\"'“”‘’-]|\d{1,4}")


def looks_like_prose(tokens: list[str]) -> bool:
    """Most tokens are words or punctuation, not identifiers, paths, numbers or operators (documentation)."""
    return sum(1 for t in tokens if _WORDLIKE.fullmatch(t)) >= 0.8 * len(tokens)


def package_versions(packages: tuple[str, ...]) -> dict[str, str | None]:
    versions = {}
    for package in packages:
        try:
            versions[package] = subprocess.run(
                ["dpkg-query", "-W", "-f=${Version}", package], capture_output=True, text=True, check=True
            ).stdout
        except (OSError, subprocess.CalledProcessError):
            versions[package] = None
    return versions


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def build_sources(out_dir: Path, names: list[str], sources: dict[str, Source] | None = None) -> dict:
    """Write train/<name>.txt and heldout/<name>.txt for each source, examples.jsonl (WordNet's usage examples,
    when wordnet is among them) and manifest.json; returns the manifest."""
    sources = sources or SOURCES
    unknown = [n for n in names if n not in sources]
    if unknown:
        raise ValueError(f"unknown sources: {', '.join(unknown)} (known: {', '.join(sources)})")
    for split in ("train", "heldout"):
        (out_dir / split).mkdir(parents=True, exist_ok=True)
    seen: set[bytes] = set()  # every kept sentence, train or held out, over all sources
    manifest = {
        "heldout_rule": f"every {HELDOUT_EVERY}th unit by crc32 of its key (training.corpus.source_heldout)",
        "tokenizer": "sacremoses Moses (en), escape=False, aggressive_dash_splits=False (service.text.moses)",
        "filters": {"min_tokens": MIN_TOKENS, "max_tokens": MAX_TOKENS, "deduplicated": "exact, across sources"},
        "sources": {},
    }
    for name in names:
        entry = manifest["sources"][name] = _write_source(out_dir, name, sources[name], seen)
        print(f"{name}: {entry['train']['tokens']:,} training tokens, {entry['heldout']['tokens']:,} held out",
              file=sys.stderr, flush=True)  # fmt: skip
    if "wordnet" in names:
        _write_examples(out_dir / "examples.jsonl")
    manifest["total"] = {
        split: {k: sum(e[split][k] for e in manifest["sources"].values()) for k in ("sentences", "tokens")}
        for split in ("train", "heldout")
    }
    (out_dir / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def _write_source(out_dir: Path, name: str, source: Source, seen: set[bytes]) -> dict:
    """One source's train/<name>.txt and heldout/<name>.txt: its sentences that pass the filters and are not in
    `seen` (which it extends); returns the source's manifest entry."""
    counts = {"units": 0, "duplicate": 0, "too_short": 0, "too_long": 0, "not_prose": 0}
    sizes = {"train": [0, 0], "heldout": [0, 0]}  # sentences, tokens
    with (
        (out_dir / "train" / f"{name}.txt").open("w", encoding="utf-8") as train_file,
        (out_dir / "heldout" / f"{name}.txt").open("w", encoding="utf-8") as heldout_file,
    ):
        for unit in source.read():
            counts["units"] += 1
            split = "heldout" if source_heldout(name, unit.key) else "train"
            out = heldout_file if split == "heldout" else train_file
            for paragraph in unit.paragraphs:
                for sentence in split_sentences(paragraph) if unit.split_sentences else [paragraph]:
                    tokens = tokenize(sentence)
                    if len(tokens) < MIN_TOKENS:
                        counts["too_short"] += 1
                        continue
                    if len(tokens) > MAX_TOKENS:
                        counts["too_long"] += 1
                        continue
                    if source.prose_filter and not looks_like_prose(tokens):
                        counts["not_prose"] += 1
                        continue
                    line = " ".join(tokens)
                    digest = hashlib.blake2b(line.encode(), digest_size=12).digest()
                    if digest in seen:
                        counts["duplicate"] += 1
                        continue
                    seen.add(digest)
                    out.write(line + "\n")
                    sizes[split][0] += 1
                    sizes[split][1] += len(tokens)
    entry = {
        "packages": package_versions(source.packages),
        "license": source.license,
        "copyright_file": source.copyright_file,
        **counts,
    }
    for split in ("train", "heldout"):
        path = out_dir / split / f"{name}.txt"
        entry[split] = {"file": f"{split}/{name}.txt", "sentences": sizes[split][0], "tokens": sizes[split][1],
                        "sha256": _sha256(path)}  # fmt: skip
    return entry


def _write_examples(path: Path) -> None:
    """WordNet's usage examples, each with its synset, lemmas and split (for the word-sense benchmarks)."""
    with path.open("w") as examples:
        for synset in read_wordnet():
            for text in synset.examples:
                split = "heldout" if source_heldout("wordnet", synset.key) else "train"
                record = {"synset": synset.key, "lemmas": synset.lemmas, "tokens": tokenize(text), "split": split}
                examples.write(json.dumps(record) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Build the WordNet gloss corpus (train.txt, heldout.txt), or with --sources the corpus of "
        "several sources (train/, heldout/, manifest.json)."
    )
    parser.add_argument("--out", default="build/corpus", type=Path)
    parser.add_argument("--wordnet", default=WORDNET_DIR, type=Path, help="folder of WordNet's data.* files")
    parser.add_argument("--sources", help=f"all, or a comma-separated list of: {', '.join(SOURCES)}")
    parser.add_argument(
        "--print-packages", action="store_true", help="print the Debian packages the --sources need, and exit"
    )
    args = parser.parse_args(argv)
    names = list(SOURCES) if args.sources == "all" else args.sources.split(",") if args.sources else None
    if args.print_packages:
        print(" ".join(p for n in names or ["wordnet"] for p in SOURCES[n].packages))
        return 0
    try:
        if names is None:
            print(json.dumps(build_corpus(args.out, args.wordnet)))
        else:
            print(json.dumps(build_sources(args.out, names)["total"]))
    except (FileNotFoundError, ValueError) as err:
        print(f"corpus: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
