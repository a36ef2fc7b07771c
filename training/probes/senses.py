"""Do the layers tell word senses apart? 1-nearest-neighbour word-sense accuracy on WordNet's usage examples.

For every word that appears (as the same token) in the usage examples of two or more WordNet synsets, each
occurrence is a query; its nearest other occurrence of that word (cosine of the word's vector in one layer) should
come from the same synset. Layer 0 is context-free: every occurrence of a word has the same vector, so it can only
guess (its score is the chance rate, ties broken at random). The sentences are WordNet's, not the tests'.

    python -m training.probes.senses --model service/embedded/default --examples build/corpus/examples.jsonl \
        [--json FILE]

`--json` also writes the table's figures; `--tie-seeds N` adds each all-queries figure's spread over N tie-break
seeds (training/passes.py reads the per-query outcomes to compare two models, `run`).
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
    the example's synset found in it (training.probes.syntax reads them too)."""
    records = [json.loads(line) for line in path.read_text().splitlines()]
    occurrences = []
    for i, r in enumerate(records):
        lemmas = {lemma.lower() for lemma in r["lemmas"] if " " not in lemma}
        occurrences += [(i, j, t.lower(), r) for j, t in enumerate(r["tokens"]) if t.lower() in lemmas]
    return [r["tokens"] for r in records], occurrences


def sentence_layers(
    model: Path, sentences: list[list[str]], needed: list[int], threads: int = 0
) -> dict[int, np.ndarray]:
    """The layers of the sentences at `needed`, from the exported model on the CPU, 256 sentences per call
    (`threads`: ONNX Runtime's intra-op threads, 0 = one per core)."""
    engine = Engine(model, provider="cpu", intra_op_threads=threads)
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


def nearest_neighbour_outcomes(
    vectors: np.ndarray, words: list[str], senses: list[str], rng, queries: set[int] | None = None
) -> dict[str, list]:
    """Each query's outcome: for each occurrence (of `queries`, default all) with a same-sense peer, its index
    (`query`), whether its nearest same-word occurrence is of the same sense (`hit`, 0 or 1), and the expected
    hit of a random same-word neighbour (`chance`). Ties are broken at random (the draws follow the queries'
    order, so the same rng seed and queries give the same outcomes)."""
    # float64: equal vectors (layer 0's, for every occurrence of a word) must give equal cosines, or float32's
    # rounding (about 6e-8 near 1, and not the same in every cell of a matmul) would break the ties, not the draws
    vectors = np.asarray(vectors, dtype=np.float64)
    unit = vectors / np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)
    by_word = defaultdict(list)
    for i, w in enumerate(words):
        by_word[w].append(i)
    out: dict[str, list] = {"query": [], "hit": [], "chance": []}
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
            out["query"].append(int(i))
            out["hit"].append(int(same[np.argmax(scores)]))
            out["chance"].append(float(same.mean()))
    return out


def nearest_neighbour_accuracy(
    vectors: np.ndarray, words: list[str], senses: list[str], rng, queries: set[int] | None = None
) -> tuple[float, float, int]:
    """(accuracy, chance, queries): the mean of nearest_neighbour_outcomes."""
    out = nearest_neighbour_outcomes(vectors, words, senses, rng, queries)
    return float(np.mean(out["hit"])), float(np.mean(out["chance"])), len(out["hit"])


def layer_views(layers: dict[int, np.ndarray], occurrences) -> list[tuple[str, np.ndarray]]:
    """(name, the occurrences' vectors) for each layer and the mean of the upper ones."""
    num_layers = next(iter(layers.values())).shape[0]
    rows = [(str(k), np.stack([layers[i][k, j] for i, j, *_ in occurrences])) for k in range(num_layers)]
    rows.append((f"mean of 1..{num_layers - 1}", np.stack([layers[i][1:, j].mean(0) for i, j, *_ in occurrences])))
    return rows


def sense_rows(layers: dict[int, np.ndarray], occurrences, tie_seeds: int = 0) -> tuple[list[dict], dict]:
    """One row per layer (and the mean of the upper ones): accuracy and chance on all queries and on the held-out
    synsets' queries (each with its own tie-break draws from seed 0, as the printed table always had them); with
    `tie_seeds`, the spread of the all-queries accuracy over that many tie-break seeds. Also each row's per-query
    outcomes ({layer: {"all": outcomes, "heldout": outcomes}}, for a paired comparison of two models)."""
    words = [o[2] for o in occurrences]
    senses = [o[3] for o in occurrences]
    held = {n for n, o in enumerate(occurrences) if o[4]}
    rows, outcomes = [], {}
    for name, vectors in layer_views(layers, occurrences):
        every = nearest_neighbour_outcomes(vectors, words, senses, np.random.default_rng(0))
        heldout = nearest_neighbour_outcomes(vectors, words, senses, np.random.default_rng(0), held)
        row = {
            "layer": name,
            "accuracy": float(np.mean(every["hit"])),
            "chance": float(np.mean(every["chance"])),
            "heldout_accuracy": float(np.mean(heldout["hit"])),
            "heldout_chance": float(np.mean(heldout["chance"])),
            "queries": len(every["hit"]),
            "heldout_queries": len(heldout["hit"]),
        }
        if tie_seeds:
            spread = [
                nearest_neighbour_accuracy(vectors, words, senses, np.random.default_rng(seed))[0]
                for seed in range(tie_seeds)
            ]
            row["tie_break"] = {"seeds": tie_seeds, "sd": float(np.std(spread)), "min": min(spread), "max": max(spread)}
        rows.append(row)
        outcomes[name] = {"all": every, "heldout": heldout}
    return rows, outcomes


def run(model: Path, examples: Path, threads: int = 0, tie_seeds: int = 0) -> tuple[dict, dict]:
    """training.probes.senses on an exported model: ({"occurrences", "words", "sentences", "rows"}, per-query outcomes
    (sense_rows'), with each query's word under "words")."""
    sentences, occurrences = load_occurrences(examples)
    needed = sorted({o[0] for o in occurrences})
    layers = sentence_layers(model, sentences, needed, threads)
    rows, outcomes = sense_rows(layers, occurrences, tie_seeds)
    words = [o[2] for o in occurrences]
    summary = {"occurrences": len(occurrences), "words": len(set(words)), "sentences": len(needed), "rows": rows}
    return summary, {"words": words, "layers": outcomes}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL_DIR)
    parser.add_argument("--examples", type=Path, default=Path("build/corpus/examples.jsonl"))
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument("--threads", type=int, default=0, help="ONNX Runtime intra-op threads (0: one per core)")
    parser.add_argument(
        "--tie-seeds",
        type=int,
        default=0,
        help="also the spread of each all-queries figure over this many tie-break seeds",
    )
    args = parser.parse_args(argv)
    summary, _ = run(args.model, args.examples, args.threads, args.tie_seeds)
    rows = summary["rows"]
    n = summary["occurrences"]
    print(f"{n} occurrences of {summary['words']} words in {summary['sentences']} WordNet usage examples")
    print("| layer | 1-NN same-sense accuracy | chance | held-out queries only | chance |")
    print("|---|---|---|---|---|")
    for r in rows:
        spread = f" (tie-break sd {r['tie_break']['sd']:.4f})" if "tie_break" in r else ""
        print(
            f"| {r['layer']} | {r['accuracy']:.3f}{spread} | {r['chance']:.3f} | {r['heldout_accuracy']:.3f} | "
            f"{r['heldout_chance']:.3f} |"
        )
    held = rows[0]["heldout_queries"]
    print(f"{rows[0]['queries']} queries; {held} from held-out synsets (sentences the language model never read)")
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1) + "\n")


if __name__ == "__main__":
    main()
