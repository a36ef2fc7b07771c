"""Do the layers tell word senses apart? 1-nearest-neighbour word-sense accuracy on WordNet's usage examples.

For every word that appears (as the same token) in the usage examples of two or more WordNet synsets, each
occurrence is a query; its nearest other occurrence of that word (cosine of the word's vector in one layer) should
come from the same synset. Layer 0 is context-free: every occurrence of a word has the same vector, so it can only
guess (its score is the chance rate, ties broken at random). The sentences are WordNet's, not the tests'.

    python -m bench.senses --model service/embedded/default --examples build/corpus/examples.jsonl

`examples.jsonl` comes from `python -m training.corpus`. The language model read these sentences in training
(all but the held-out synsets'), never their sense labels; `held-out queries` counts only sentences it never read.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import numpy as np

from service.engine.session import Engine
from service.settings import DEFAULT_MODEL_DIR

MIN_SENSES = 2


def lemma_occurrences(path: Path) -> tuple[list[list[str]], list[tuple[int, int, str, dict]]]:
    """The examples' sentences, and (sentence, position, word, its example's record) for each lemma (one word) of
    the example's synset found in it (bench.syntax reads them too)."""
    records = [json.loads(line) for line in path.read_text().splitlines()]
    occurrences = []
    for i, r in enumerate(records):
        lemmas = {lemma.lower() for lemma in r["lemmas"] if " " not in lemma}
        occurrences += [(i, j, t.lower(), r) for j, t in enumerate(r["tokens"]) if t.lower() in lemmas]
    return [r["tokens"] for r in records], occurrences


def sentence_layers(model: Path, sentences: list[list[str]], needed: list[int]) -> dict[int, np.ndarray]:
    """The layers of the sentences at `needed`, from the exported model on the CPU, 256 sentences per call."""
    engine = Engine(model, provider="cpu")
    layers = {}
    for start in range(0, len(needed), 256):
        chunk = needed[start : start + 256]
        layers.update(zip(chunk, engine.run([sentences[i] for i in chunk]), strict=True))
    return layers


def load_occurrences(path: Path) -> tuple[list[list[str]], list[tuple[int, int, str, str, bool]]]:
    """Sentences, and (sentence, position, word, synset, held_out) for each example word that is a lemma of its
    synset and appears in the examples of at least two synsets."""
    sentences, found = lemma_occurrences(path)
    occurrences = [(i, j, word, r["synset"], r["split"] == "heldout") for i, j, word, r in found]
    synsets = defaultdict(set)
    for _, _, word, synset, _ in occurrences:
        synsets[word].add(synset)
    kept = [o for o in occurrences if len(synsets[o[2]]) >= MIN_SENSES]
    return sentences, kept


def nearest_neighbour_accuracy(
    vectors: np.ndarray, words: list[str], senses: list[str], rng, queries: set[int] | None = None
) -> tuple[float, float, int]:
    """(accuracy, chance, queries): for each occurrence (of `queries`, default all) with a same-sense peer, is its
    nearest same-word occurrence of the same sense? Chance: the expected accuracy of a random same-word
    neighbour. Ties are broken at random."""
    unit = vectors / np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)
    by_word = defaultdict(list)
    for i, w in enumerate(words):
        by_word[w].append(i)
    hits, chance, n = 0.0, 0.0, 0
    for members in by_word.values():
        m = np.array(members)
        sims = unit[m] @ unit[m].T
        for a, i in enumerate(m):
            if queries is not None and i not in queries:
                continue
            others = np.delete(np.arange(len(m)), a)
            same = np.array([senses[m[o]] == senses[i] for o in others])
            if not same.any():
                continue  # a lone sense: no right answer to find
            scores = sims[a, others] + rng.uniform(0, 1e-9, len(others))  # random tie-break
            hits += float(same[np.argmax(scores)])
            chance += same.mean()
            n += 1
    return hits / n, chance / n, n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL_DIR)
    parser.add_argument("--examples", type=Path, default=Path("build/corpus/examples.jsonl"))
    args = parser.parse_args()
    sentences, occurrences = load_occurrences(args.examples)
    needed = sorted({o[0] for o in occurrences})
    layers = sentence_layers(args.model, sentences, needed)
    num_layers = next(iter(layers.values())).shape[0]
    words = [o[2] for o in occurrences]
    senses = [o[3] for o in occurrences]
    print(f"{len(occurrences)} occurrences of {len(set(words))} words in {len(needed)} WordNet usage examples")
    held = {n for n, o in enumerate(occurrences) if o[4]}
    print("| layer | 1-NN same-sense accuracy | chance | held-out queries only | chance |")
    print("|---|---|---|---|---|")
    rows = [(str(k), np.stack([layers[i][k, j] for i, j, *_ in occurrences])) for k in range(num_layers)]
    rows.append((f"mean of 1..{num_layers - 1}", np.stack([layers[i][1:, j].mean(0) for i, j, *_ in occurrences])))
    for name, vectors in rows:
        acc, chance, n = nearest_neighbour_accuracy(vectors, words, senses, np.random.default_rng(0))
        h_acc, h_chance, h_n = nearest_neighbour_accuracy(vectors, words, senses, np.random.default_rng(0), held)
        print(f"| {name} | {acc:.3f} | {chance:.3f} | {h_acc:.3f} | {h_chance:.3f} |")
    print(f"{n} queries; {h_n} from held-out synsets (sentences the language model never read)")


if __name__ == "__main__":
    main()
