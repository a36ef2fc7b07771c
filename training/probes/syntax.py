"""Which layer carries syntax? A linear probe of the part of speech of WordNet lemmas in their usage examples.

Every usage example of a WordNet synset that contains one of the synset's lemmas (a single word) labels that
occurrence with the synset's part of speech: noun, verb, adjective (satellites included) or adverb. "the bank
is on the corner" gives `bank` = noun, "bank on your good education" gives `bank` = verb. A ridge-regression
classifier (one-vs-rest, closed form, features standardized) is fitted per layer on the training synsets'
occurrences and scored on the held-out synsets' (sentences the language model never read, and senses the probe
never saw). Layer 0 (the char-CNN) sees only the word, so on words used in several parts of speech it can only
guess by spelling; the upper layers see the context. `ambiguous` scores only the occurrences of words that the
examples show in two or more parts of speech, the ones where context must decide.

    python -m training.probes.syntax --model service/embedded/default --examples build/corpus/examples.jsonl
    python -m training.probes.syntax --model build/models/random-control ...   # the same architecture, random weights

Prints a table per layer: accuracy on all held-out occurrences and on the ambiguous ones, with the majority
class's accuracy beside them.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np

from service.settings import DEFAULT_MODEL_DIR
from training.probes.senses import lemma_occurrences, sentence_layers

POS = {"n": "noun", "v": "verb", "a": "adjective", "s": "adjective", "r": "adverb"}
RIDGE = 1.0  # L2 penalty, on standardized features


def load_occurrences(path: Path) -> tuple[list[list[str]], list[tuple[int, int, str, str, bool]]]:
    """Sentences, and (sentence, position, word, part of speech, held_out) for each lemma (one word) of the
    example's synset found in it."""
    sentences, found = lemma_occurrences(path)
    return sentences, [(i, j, word, POS[r["synset"][0]], r["split"] == "heldout") for i, j, word, r in found]


def ambiguous_words(occurrences) -> set[str]:
    parts = defaultdict(set)
    for _, _, word, pos, _ in occurrences:
        parts[word].add(pos)
    return {w for w, p in parts.items() if len(p) > 1}


def ridge_probe(train_x: np.ndarray, train_y: list[str], test_x: np.ndarray) -> list[str]:
    """One-vs-rest ridge regression on standardized features: the class whose score is highest."""
    classes = sorted(set(train_y))
    mean, std = train_x.mean(0), train_x.std(0) + 1e-6
    a, b = (train_x - mean) / std, (test_x - mean) / std
    a = np.hstack([a, np.ones((len(a), 1))])
    b = np.hstack([b, np.ones((len(b), 1))])
    targets = np.array([[1.0 if y == c else -1.0 for c in classes] for y in train_y])
    w = np.linalg.solve(a.T @ a + RIDGE * np.eye(a.shape[1]), a.T @ targets)
    return [classes[k] for k in np.argmax(b @ w, axis=1)]


def probe_layers(layers: dict[int, np.ndarray], occurrences) -> list[dict]:
    """layers: sentence index -> (num_layers, tokens, dim). One row per layer (and the mean of the upper ones)."""
    return probe_layer_outcomes(layers, occurrences)[0]


def probe_layer_outcomes(layers: dict[int, np.ndarray], occurrences) -> tuple[list[dict], dict]:
    """probe_layers' rows, and each held-out occurrence's outcome per layer: {"test": occurrence indexes,
    "ambiguous": whether each is of an ambiguous word, "layers": {layer: [1 if right else 0, ...]}} (for a paired
    comparison of two models on the same occurrences)."""
    train = [n for n, o in enumerate(occurrences) if not o[4]]
    test = [n for n, o in enumerate(occurrences) if o[4]]
    if not train or not test:
        raise ValueError("the examples need occurrences from training and from held-out synsets")
    ambiguous = ambiguous_words(occurrences)
    labels = [o[3] for o in occurrences]
    majority = Counter(labels[n] for n in train).most_common(1)[0][0]
    test_ambiguous = [k for k, n in enumerate(test) if occurrences[n][2] in ambiguous]
    num_layers = next(iter(layers.values())).shape[0]
    rows, right_by_layer = [], {}
    views = [(str(k), lambda v, k=k: v[k]) for k in range(num_layers)]
    views.append((f"mean of 1..{num_layers - 1}", lambda v: v[1:].mean(0)))
    for name, view in views:
        vectors = np.stack([view(layers[i])[j] for i, j, *_ in occurrences]).astype(np.float64)
        predicted = ridge_probe(vectors[train], [labels[n] for n in train], vectors[test])
        right = [predicted[k] == labels[n] for k, n in enumerate(test)]
        right_by_layer[name] = [int(r) for r in right]
        rows.append(
            {
                "layer": name,
                "accuracy": float(np.mean(right)),
                "ambiguous_accuracy": float(np.mean([right[k] for k in test_ambiguous])) if test_ambiguous else None,
            }
        )
    for row in rows:
        row["majority"] = float(np.mean([labels[n] == majority for n in test]))
        row["ambiguous_majority"] = (
            float(np.mean([labels[test[k]] == majority for k in test_ambiguous])) if test_ambiguous else None
        )
        row["test"], row["ambiguous"], row["train"] = len(test), len(test_ambiguous), len(train)
    ambiguous_test = [int(occurrences[n][2] in ambiguous) for n in test]
    return rows, {"test": test, "ambiguous": ambiguous_test, "layers": right_by_layer}


def run(model: Path, examples: Path, threads: int = 0) -> list[dict]:
    return run_with_outcomes(model, examples, threads)[0]


def run_with_outcomes(model: Path, examples: Path, threads: int = 0) -> tuple[list[dict], dict]:
    """run's rows and probe_layer_outcomes' outcomes, each held-out occurrence's word under "words"."""
    sentences, occurrences = load_occurrences(examples)
    layers = sentence_layers(model, sentences, sorted({o[0] for o in occurrences}), threads)
    rows, outcomes = probe_layer_outcomes(layers, occurrences)
    return rows, outcomes | {"words": [occurrences[n][2] for n in outcomes["test"]]}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL_DIR)
    parser.add_argument("--examples", type=Path, default=Path("build/corpus/examples.jsonl"))
    parser.add_argument("--json", type=Path, help="also write the rows here")
    parser.add_argument("--threads", type=int, default=0, help="ONNX Runtime intra-op threads (0: one per core)")
    args = parser.parse_args(argv)
    rows = run(args.model, args.examples, args.threads)
    r0 = rows[0]
    print(f"{r0['train']} training occurrences; {r0['test']} held-out ones, {r0['ambiguous']} of ambiguous words")
    print("| layer | part-of-speech accuracy | majority class | ambiguous words only | majority class |")
    print("|---|---|---|---|---|")
    for r in rows:
        amb = f"{r['ambiguous_accuracy']:.3f} | {r['ambiguous_majority']:.3f}" if r["ambiguous"] else "- | -"
        print(f"| {r['layer']} | {r['accuracy']:.3f} | {r['majority']:.3f} | {amb} |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
