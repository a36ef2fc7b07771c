"""Held-out perplexity of trained models on the same text over the same vocabulary, so that models trained with
different vocabularies (other sizes, other corpora) can be compared.

    python -m training.evaluate --models models/default build/train-default \
        --heldout build/corpus-all/heldout/*.txt
    python -m training.evaluate --models build/train-cpu --vocabulary-of models/default --heldout ...

A model's own perplexity (elmo-train's) counts every word outside its vocabulary as one class, <UNK>: a model whose
vocabulary covers less of the text has fewer distinct words to predict and scores lower without being better.
Here every model predicts the same events: each word of the vocabulary that all the models share (the
intersection of their vocab.txt), or "a word outside the shared vocabulary", whose probability under a model is
its P(<UNK>) plus the probabilities of its own words outside the shared vocabulary. Reads elmo-train's output
folders (options.json, weights.hdf5, softmax.hdf5, vocab.txt), from the zero initial state, in float32.
`--vocabulary-of` adds folders whose vocabulary joins the shared one without being evaluated: a model measured
earlier keeps its figures, and a new one is measured on the same events. The row `all` pools every file's
predictions (no second pass over the text).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np
import torch

from model_export.options import load_options
from training.language_model import BiLanguageModel, TokenTable, pad_batch
from training.trainer import can_continue_softmax, init_from, read_sentences
from training.vocab import UNK, Vocabulary


def load_language_model(folder: Path) -> tuple[BiLanguageModel, Vocabulary]:
    if not can_continue_softmax(folder):
        raise ValueError(f"{folder} has no softmax.hdf5 and vocab.txt: not an elmo-train output folder")
    vocab = Vocabulary.load(folder / "vocab.txt")
    model = BiLanguageModel(load_options(folder / "options.json"), len(vocab), dropout=0.0)
    init_from(model, folder)
    return model.eval(), vocab


def shared_vocabulary(vocabs: list[Vocabulary]) -> list[str]:
    """The words every vocabulary has, in the first one's order (<UNK> stands for all the others)."""
    common = set.intersection(*(set(v.words) for v in vocabs))
    return [w for w in vocabs[0].words if w in common]


@torch.no_grad()
def shared_perplexity(
    model: BiLanguageModel, vocab: Vocabulary, shared: list[str], sentences: list[list[str]], batch_size: int = 64
) -> dict:
    """Perplexity per direction of `model` on `sentences`, predicting the words of `shared` and, for any other
    word, the class of all the words outside `shared` (vocab's <UNK> and its own words outside `shared`)."""
    in_shared = np.zeros(len(vocab), dtype=bool)
    in_shared[[vocab.index[w] for w in shared if w != UNK]] = True
    outside = torch.from_numpy(np.flatnonzero(~in_shared))  # the model's ids of "a word outside the shared set"
    table = TokenTable(vocab, model.bilm.options.max_chars)
    rows = [table.encode(s) for s in sentences]
    type_chars, type_ids = table.tensors()
    # each type's class: its own id if shared, -1 for the outside class
    type_class = torch.where(torch.from_numpy(in_shared)[type_ids], type_ids, torch.full_like(type_ids, -1))
    nll = {"forward": 0.0, "backward": 0.0}
    count = 0
    order = sorted(range(len(rows)), key=lambda i: len(rows[i]))
    for start in range(0, len(order), batch_size):
        batch = pad_batch([rows[i] for i in order[start : start + batch_size]])
        for direction, (h, words) in zip(nll, model.predictions(batch, type_chars), strict=True):
            log_p = model.softmax.log_prob(h)  # (N, V)
            target = type_class[words]
            outside_log_p = torch.logsumexp(log_p[:, outside], dim=-1)
            picked = torch.where(target >= 0, log_p.gather(1, target.clamp(min=0)[:, None])[:, 0], outside_log_p)
            nll[direction] -= float(picked.sum())
        count += len(words)
    return {d: round(math.exp(v / count), 2) for d, v in nll.items()} | {"predictions": count, "nll": nll}


def pooled(results: list[dict]) -> dict:
    """The perplexity of several texts together, from each one's shared_perplexity (no second pass)."""
    count = sum(r["predictions"] for r in results)
    nll = {d: sum(r["nll"][d] for r in results) for d in ("forward", "backward")}
    return {d: round(math.exp(v / count), 2) for d, v in nll.items()} | {"predictions": count, "nll": nll}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", required=True, type=Path, help="elmo-train output folders")
    parser.add_argument("--heldout", nargs="+", required=True, type=Path, help="held-out text files, one per source")
    parser.add_argument(
        "--vocabulary-of",
        nargs="*",
        default=[],
        type=Path,
        help="more elmo-train folders whose vocab.txt joins the shared vocabulary, not evaluated (to add a model "
        "to a table made earlier with them)",
    )
    parser.add_argument("--threads", type=int, help="torch threads")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        loaded = [load_language_model(folder) for folder in args.models]
    except (ValueError, OSError) as err:
        print(f"evaluate: {err}", file=sys.stderr)
        return 1
    others = [Vocabulary.load(folder / "vocab.txt") for folder in args.vocabulary_of]
    shared = shared_vocabulary([v for _, v in loaded] + others)
    sets = {path.stem: read_sentences([path]) for path in args.heldout}
    every = [s for path in args.heldout for s in sets[path.stem]]
    tokens = {name: sum(map(len, s)) for name, s in [*sets.items(), ("all", every)]}
    known = set(shared)
    covered = {name: sum(w in known for x in s for w in x) / max(1, tokens[name]) for name, s in sets.items()}
    covered["all"] = sum(covered[name] * tokens[name] for name in sets) / max(1, tokens["all"])
    sizes = ", ".join(f"{len(v):,}" for v in [v for _, v in loaded] + others)
    print(f"shared vocabulary: {len(shared):,} words (of {sizes})")
    header = " | ".join(f"{folder} forward | backward" for folder in args.models)
    print(f"| held out | tokens | in the shared vocabulary | {header} |")
    print("|---|---|---|" + "---|---|" * len(args.models))
    results = {}

    def row(name: str, ppls: list[dict]) -> None:
        cells = [f"{ppl[d]}" for ppl in ppls for d in ("forward", "backward")]
        print(f"| {name} | {tokens[name]:,} | {100 * covered[name]:.1f}% | {' | '.join(cells)} |", flush=True)

    for name, sentences in sets.items():
        results[name] = [shared_perplexity(model, vocab, shared, sentences) for model, vocab in loaded]
        row(name, results[name])
    row("all", [pooled([r[k] for r in results.values()]) for k in range(len(loaded))])
    return 0


if __name__ == "__main__":
    sys.exit(main())
