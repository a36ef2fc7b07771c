"""The figures of one finished pass of a training run, for the per-pass table of the model card, and the rule that
says whether a pass may replace the shipped model.

    python -m training.passes measure build/train-cpu/passes/1 \
        --heldout build/corpus-all/heldout/*.txt --corpus build/corpus-all/train/*.txt \
        --examples build/corpus/examples.jsonl --shared-with models/default \
        --allennlp /work/allennlp-venv/bin/python --threads 1 --baseline build/passes/baseline/figures.json
    python -m training.passes measure models/default --work build/passes/baseline \
        --heldout build/corpus-all/heldout/*.txt --examples build/corpus/examples.jsonl \
        --shared-with build/train-cpu/passes/1 --allennlp /work/allennlp-venv/bin/python --threads 1
    python -m training.passes table build/passes/baseline/figures.json build/train-cpu/passes/*/figures.json \
        --baseline build/passes/baseline/figures.json --out build/train-cpu/passes/table.md

`measure` takes an elmo-train output folder (or one of its `passes/N/` folders: options.json, weights.hdf5,
vocab.txt, softmax.hdf5) and writes, into its work folder (default: the model's folder), `figures.json` (every
figure below), `outcomes.json` (each query's outcome, for the noise) and `onnx/` (the export), and prints them:

- held-out perplexity per direction from the zero state, over the model's own vocabulary, on the held-out files
  pooled and per file (elmo-train's figure), and the interpolated Kneser-Ney bigram's on the same vocabulary and
  text, trained on `--corpus` (the run's training text; computed once and cached, by default as
  `passes/bigram.json` beside the passes: it does not change between passes), and how far below it the model is;
- with `--shared-with`, the perplexity on the words that this vocabulary and theirs share (training/evaluate.py):
  the figure that compares models of different vocabularies, such as a pass and today's default model;
- the senses probe (`training.probes.senses`: best upper layer on all queries, the same layer on the held-out
  synsets' queries, layer 0 against its chance rate, each all-queries figure's spread over 20 tie-break seeds) and
  the syntax probe (`training.probes.syntax`: every layer, on held-out occurrences and on those of ambiguous
  words), for the model and for the control: the same architecture
  with random weights (random_bilm seed 0, the weights the run started from; measured once per architecture and
  cached under `--cache`);
- with `--allennlp PYTHON`: allennlp 2.10.1's `_ElmoBiLm` (bench/allennlp_baseline.py, stateless, the 200
  held-out sentences in one batch) against `elmo-embed` on the export: the max abs error over every layer
  (bar: <= 1e-5).

The noise. Two models are compared on the same queries, so the comparison is paired: a bootstrap over the
queries' words (a cluster bootstrap: every query of a resampled word comes along, since one word's queries share
their candidates and are not independent), 1,000 resamples from seed 0, gives the standard error and the 95%
percentile interval of the difference between the two models' accuracies; the same resampling gives each
figure's own standard error. The tie-break seed's spread (senses: 20 seeds) is reported beside it. A model is
"worse beyond the noise" on a figure when the whole 95% interval of (candidate - baseline) is below zero.

`decide` is the shipping rule (docs/training.md): held-out perplexity >= 30% below the bigram in both directions,
the senses probe better than the random-weights control beyond the noise, not worse than the model it replaces
beyond the noise on the senses probe (all queries and held-out queries, best upper layer) and the syntax probe
(held-out and ambiguous occurrences, best upper layer), and allennlp's agreement within its bar. `gate` is that rule
as a command: both models measured (or read from the cache), every figure printed with its interval, exit status 1
when a condition fails. `table` builds the model card's per-pass table (one row per model) with the comparison and
the decision. `release` writes a pass as a finished run's folder, and with `--to` copies it where it is committed.

    python -m training.passes gate build/train-cpu/passes/1 --against models/default \
        --heldout build/corpus-all/heldout/*.txt --corpus build/corpus-all/train/*.txt \
        --examples build/corpus-all/examples.jsonl --allennlp /work/allennlp-venv/bin/python
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np
import torch

from model_export.export import export_published
from model_export.options import load_options
from model_export.weights import random_bilm, write_published_weights
from service.cli import embed_main
from training.bigram import bigram_perplexities
from training.evaluate import load_language_model, pooled, shared_perplexity, shared_vocabulary
from training.language_model import TokenTable, perplexity
from training.probes import senses, syntax
from training.probes.senses import load_occurrences as sense_occurrences
from training.probes.senses import sense_rows, sentence_layers
from training.probes.syntax import load_occurrences as syntax_occurrences
from training.probes.syntax import probe_layer_outcomes
from training.trainer import PASS_STATE, copy_released, read_sentences, release_pass
from training.vocab import Vocabulary

REPO = Path(__file__).resolve().parent.parent
ALLENNLP_SCRIPT = REPO / "bench" / "allennlp_baseline.py"
ALLENNLP_SENTENCES = 200
ALLENNLP_BAR = 1e-5  # max abs error over every layer
BELOW_BIGRAM_GOAL = 0.30  # held-out perplexity at least 30% below the Kneser-Ney bigram's, each direction
RESAMPLES = 1000
TIE_SEEDS = 20
NOISE_METHOD = (
    "paired cluster bootstrap over the queries' words (all of a resampled word's queries come along), "
    f"{RESAMPLES} resamples from seed 0: standard error and 95% percentile interval of (candidate - baseline) on "
    "the same queries; worse beyond the noise = the whole interval below zero"
)


# -- files and caches


def _sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _files_key(paths: list[Path]) -> list[list]:
    """The files by name and size, in name order (a shell's glob may order them otherwise)."""
    return sorted([Path(p).name, Path(p).stat().st_size] for p in paths)


def pass_number(folder: Path) -> int | None:
    """N for a `passes/N/` folder of elmo-train, or for a pass released elsewhere (its state.json says), else None."""
    folder = Path(folder)
    if folder.parent.name == "passes" and folder.name.isdigit():
        return int(folder.name)
    if (folder / PASS_STATE).exists():
        return json.loads((folder / PASS_STATE).read_text())["epoch"]
    return None


def default_bigram_cache(folder: Path, work: Path) -> Path:
    """`passes/bigram.json` beside the passes of a run, else the work folder's bigram.json."""
    return folder.parent / "bigram.json" if folder.parent.name == "passes" else work / "bigram.json"


def export(folder: Path, onnx_dir: Path) -> Path:
    """elmo-export of the folder's options.json + weights.hdf5 into onnx_dir, unless it holds an export of these
    very weights already."""
    manifest = onnx_dir / "manifest.json"
    weights = folder / "weights.hdf5"
    if manifest.exists() and json.loads(manifest.read_text()).get("sources", {}).get("weights", {}).get(
        "sha256"
    ) == _sha256(weights):
        return onnx_dir
    export_published(folder / "options.json", weights, onnx_dir)
    return onnx_dir


# -- perplexity


@torch.no_grad()
def heldout_perplexity(folder: Path, heldout: list[Path]) -> dict:
    """Zero-state perplexity per direction over the model's own vocabulary (<UNK> one class), pooled over the
    held-out files and per file: the figure elmo-train prints at each pass's end."""
    model, vocab = load_language_model(folder)
    table = TokenTable(vocab, model.bilm.options.max_chars)
    by_file, nll, count = {}, {"forward": 0.0, "backward": 0.0}, 0
    for path in heldout:
        ppl = perplexity(model, [table.encode(s) for s in read_sentences([path])], table)
        by_file[Path(path).stem] = ppl.as_dict()
        nll["forward"] += math.log(ppl.forward) * ppl.predictions
        nll["backward"] += math.log(ppl.backward) * ppl.predictions
        count += ppl.predictions
    pooled_ppl = {d: round(math.exp(v / count), 2) for d, v in nll.items()}
    return pooled_ppl | {"predictions": count, "by_file": by_file}


def shared_vocabulary_perplexity(folder: Path, others: list[Path], heldout: list[Path]) -> dict:
    """training.evaluate's perplexity on the words that the folder's vocabulary and the others' (folders or
    vocab.txt files) share, pooled and per file."""
    model, vocab = load_language_model(folder)
    vocabs = [vocab] + [Vocabulary.load(p / "vocab.txt" if Path(p).is_dir() else p) for p in others]
    shared = shared_vocabulary(vocabs)
    results = {Path(p).stem: shared_perplexity(model, vocab, shared, read_sentences([p])) for p in heldout}
    every = pooled(list(results.values()))
    by_file = {name: {d: r[d] for d in ("forward", "backward", "predictions")} for name, r in results.items()}
    return {
        "forward": every["forward"],
        "backward": every["backward"],
        "predictions": every["predictions"],
        "shared_words": len(shared),
        "with": [str(p) for p in others],
        "by_file": by_file,
    }


def bigram_figures(vocab_path: Path, corpus: list[Path], heldout: list[Path], cache: Path) -> dict:
    """The Kneser-Ney bigram's held-out perplexity (pooled and per file) on the vocabulary of vocab_path, trained
    on the corpus; read from `cache` when it was computed for the same vocabulary and files, else computed (a few
    minutes on 15 M words) and written there."""
    key = {"vocab_sha256": _sha256(vocab_path), "corpus": _files_key(corpus), "heldout": _files_key(heldout)}
    if cache.exists():
        cached = json.loads(cache.read_text())
        if cached.get("key") == key:
            return cached["figures"]
    vocab = Vocabulary.load(vocab_path)
    sets = {Path(p).stem: read_sentences([p]) for p in heldout}
    every = [s for sentences in sets.values() for s in sentences]
    figures = bigram_perplexities(vocab, read_sentences(corpus), {"all": every, **sets})
    result = figures.pop("all") | {"by_file": figures}
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text(json.dumps({"key": key, "figures": result}, indent=1) + "\n")
    return result


def below(model_ppl: dict, bigram_ppl: dict) -> dict:
    """How far below the bigram's perplexity the model's is, per direction, in percent."""
    return {d: round(100 * (1 - model_ppl[d] / bigram_ppl[d]), 2) for d in ("forward", "backward")}


# -- the probes


def probes(onnx_dir: Path, examples: Path, threads: int, tie_seeds: int = TIE_SEEDS) -> tuple[dict, dict]:
    """The senses and syntax probes on an exported model, the sentences embedded once for both: (figures, per-query
    outcomes)."""
    sentences, senses_occ = sense_occurrences(examples)
    _, syntax_occ = syntax_occurrences(examples)
    needed = sorted({o[0] for o in senses_occ} | {o[0] for o in syntax_occ})
    layers = sentence_layers(onnx_dir, sentences, needed, threads)
    sense_table, sense_out = sense_rows(layers, senses_occ, tie_seeds)
    syntax_table, syntax_out = probe_layer_outcomes(layers, syntax_occ)
    figures = {"senses": summarize_senses(sense_table), "syntax": summarize_syntax(syntax_table)}
    outcomes = {
        "senses": {"words": [o[2] for o in senses_occ], "layers": sense_out},
        "syntax": syntax_out | {"words": [syntax_occ[n][2] for n in syntax_out["test"]]},
    }
    return figures, outcomes


def _upper(rows: list[dict]) -> list[dict]:
    return [r for r in rows if r["layer"].isdigit() and r["layer"] != "0"]


def summarize_senses(rows: list[dict]) -> dict:
    """The table, and the figures of the shipping rule: the best upper layer on all queries (its held-out-queries
    figure beside it) and layer 0 against chance."""
    best = max(_upper(rows), key=lambda r: r["accuracy"])
    zero = rows[0]
    return {
        "rows": rows,
        "best_layer": best["layer"],
        "all": best["accuracy"],
        "heldout": best["heldout_accuracy"],
        "chance": best["chance"],
        "heldout_chance": best["heldout_chance"],
        "layer0": zero["accuracy"],
        "layer0_heldout": zero["heldout_accuracy"],
        "queries": best["queries"],
        "heldout_queries": best["heldout_queries"],
    }


def summarize_syntax(rows: list[dict]) -> dict:
    best = max(_upper(rows), key=lambda r: r["accuracy"])
    return {
        "rows": rows,
        "best_layer": best["layer"],
        "heldout": best["accuracy"],
        "ambiguous": best["ambiguous_accuracy"],
        "majority": best["majority"],
        "test": best["test"],
        "ambiguous_test": best["ambiguous"],
    }


def control(options_path: Path, examples: Path, cache: Path, threads: int) -> tuple[dict, dict]:
    """The probes on the same architecture with random weights (random_bilm seed 0), cached under `cache` per
    architecture, examples file and version of training/probes/senses.py and training/probes/syntax.py."""
    shape = json.dumps(load_options(options_path).to_dict(), sort_keys=True)
    probes_code = "".join(_sha256(Path(module.__file__)) for module in (senses, syntax))
    key = hashlib.sha256((shape + _sha256(examples) + probes_code).encode())
    folder = cache / f"control-{key.hexdigest()[:12]}"
    figures_path, outcomes_path = folder / "figures.json", folder / "outcomes.json"
    if figures_path.exists() and outcomes_path.exists():
        return json.loads(figures_path.read_text()), json.loads(outcomes_path.read_text())
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "options.json").write_bytes(Path(options_path).read_bytes())
    write_published_weights(random_bilm(load_options(options_path), seed=0), folder / "weights.hdf5")
    figures, outcomes = probes(export(folder, folder / "onnx"), examples, threads)
    outcomes_path.write_text(json.dumps(outcomes) + "\n")
    figures_path.write_text(json.dumps(figures, indent=1) + "\n")
    return figures, outcomes


# -- allennlp's agreement


def agreement_sentences(heldout: list[Path], n: int = ALLENNLP_SENTENCES) -> list[list[str]]:
    """n held-out sentences spread evenly over the pooled held-out files (every k-th)."""
    every = read_sentences(heldout)
    step = max(1, len(every) // n)
    return every[::step][:n]


def allennlp_agreement(folder: Path, onnx_dir: Path, heldout: list[Path], python: str, threads: int) -> dict:
    """allennlp 2.10.1's _ElmoBiLm (stateless, the sentences in one batch) against elmo-embed on the export: max
    abs error over every layer of every sentence."""
    sentences = agreement_sentences(heldout)
    with tempfile.TemporaryDirectory() as tmp:
        text = Path(tmp) / "sentences.txt"
        text.write_text("".join(" ".join(s) + "\n" for s in sentences), encoding="utf-8")
        theirs, ours = Path(tmp) / "allennlp.hdf5", Path(tmp) / "elmo-embed.hdf5"
        command = [python, str(ALLENNLP_SCRIPT), "--options", str(folder / "options.json"), "--weights",
                   str(folder / "weights.hdf5"), "--input", str(text), "--batch-size", str(len(sentences)),
                   "--threads", str(threads), "--stateless", "--output", str(theirs)]  # fmt: skip
        run = subprocess.run(command, capture_output=True, text=True)
        if run.returncode != 0:
            raise RuntimeError(f"bench/allennlp_baseline.py failed: {run.stderr[-2000:]}")
        if embed_main(["--model", str(onnx_dir), str(text), str(ours), "--provider", "cpu",
                       "--threads", str(threads), "--no-progress"]) != 0:  # fmt: skip
            raise RuntimeError("elmo-embed failed")
        worst = 0.0
        with h5py.File(theirs) as a, h5py.File(ours) as b:
            for i in range(len(sentences)):
                x, y = a[str(i)][...], b[str(i)][...]
                if x.shape != y.shape:
                    raise RuntimeError(f"sentence {i}: allennlp's shape {x.shape}, elmo-embed's {y.shape}")
                worst = max(worst, float(np.abs(x - y).max()))
    return {
        "max_abs_error": worst,
        "sentences": len(sentences),
        "tokens": sum(map(len, sentences)),
        "bar": ALLENNLP_BAR,
        "met": worst <= ALLENNLP_BAR,
        "how": "allennlp 2.10.1 _ElmoBiLm, stateless, one batch, against elmo-embed --provider cpu (fp32)",
    }


# -- the noise


def cluster_bootstrap(
    a: list[float], b: list[float] | None, clusters: list, resamples: int = RESAMPLES, seed: int = 0
) -> dict:
    """mean(a) - mean(b) on the same items (or mean(a) alone, b None), with its standard error and 95% percentile
    interval from resampling the clusters (all of a drawn cluster's items come along)."""
    a = np.asarray(a, dtype=float)
    values = a - np.asarray(b, dtype=float) if b is not None else a
    if len(values) != len(clusters):
        raise ValueError("one cluster label per item")
    _, cluster_ids = np.unique(np.asarray(clusters, dtype=object).astype(str), return_inverse=True)
    k = cluster_ids.max() + 1
    sums = np.bincount(cluster_ids, weights=values, minlength=k)
    counts = np.bincount(cluster_ids, minlength=k).astype(float)
    draws = np.random.default_rng(seed).integers(0, k, size=(resamples, k))
    stats = sums[draws].sum(1) / counts[draws].sum(1)
    low, high = np.percentile(stats, [2.5, 97.5])
    return {
        "value": float(values.mean()),
        "se": float(stats.std(ddof=1)),
        "ci95": [float(low), float(high)],
        "items": len(values),
        "clusters": int(k),
    }


def _same(what: str, x: list, y: list) -> None:
    if x != y:
        raise ValueError(f"{what}: the two models were measured on different queries (another examples file?)")


def compare(baseline: tuple[dict, dict], candidate: tuple[dict, dict]) -> dict:
    """The paired differences (candidate - baseline) of the rule's figures, each with its noise: baseline and
    candidate are (figures, outcomes) of `measure`."""
    (bf, bo), (cf, co) = baseline, candidate
    out = {"method": NOISE_METHOD}
    bs, cs = bo["senses"], co["senses"]
    _same("senses", bs["words"], cs["words"])
    for name in ("all", "heldout"):
        b = bs["layers"][bf["senses"]["best_layer"]][name]
        c = cs["layers"][cf["senses"]["best_layer"]][name]
        _same(f"senses {name}", b["query"], c["query"])
        words = [cs["words"][q] for q in c["query"]]
        out[f"senses_{name}"] = cluster_bootstrap(c["hit"], b["hit"], words)
    bx, cx = bo["syntax"], co["syntax"]
    _same("syntax", bx["test"], cx["test"])
    b = bx["layers"][bf["syntax"]["best_layer"]]
    c = cx["layers"][cf["syntax"]["best_layer"]]
    out["syntax_heldout"] = cluster_bootstrap(c, b, cx["words"])
    amb = [k for k, flag in enumerate(cx["ambiguous"]) if flag]
    out["syntax_ambiguous"] = cluster_bootstrap([c[k] for k in amb], [b[k] for k in amb], [cx["words"][k] for k in amb])
    return out


def own_noise(figures: dict, outcomes: dict) -> dict:
    """Each rule figure's own standard error (the same resampling), and layer 0's distance from its chance rate."""
    s, x = outcomes["senses"], outcomes["syntax"]
    out = {}
    for name in ("all", "heldout"):
        o = s["layers"][figures["senses"]["best_layer"]][name]
        out[f"senses_{name}"] = cluster_bootstrap(o["hit"], None, [s["words"][q] for q in o["query"]])
    zero = s["layers"]["0"]["all"]
    out["senses_layer0_minus_chance"] = cluster_bootstrap(
        zero["hit"], zero["chance"], [s["words"][q] for q in zero["query"]]
    )
    right = x["layers"][figures["syntax"]["best_layer"]]
    out["syntax_heldout"] = cluster_bootstrap(right, None, x["words"])
    amb = [k for k, flag in enumerate(x["ambiguous"]) if flag]
    out["syntax_ambiguous"] = cluster_bootstrap([right[k] for k in amb], None, [x["words"][k] for k in amb])
    return out


# -- the shipping rule


@dataclass(frozen=True)
class Decision:
    conditions: list[tuple[bool, str]]  # one per criterion: met or not, and the figure with its interval

    @property
    def ship(self) -> bool:
        return all(met for met, _ in self.conditions)

    @property
    def reasons(self) -> list[str]:
        return [text for _, text in self.conditions]

    def describe(self) -> str:
        return ("ship" if self.ship else "do not ship") + ": " + "; ".join(self.reasons)


# The rule's paired comparisons: the key in compare()'s noise, its label, and where the figure is in measure()'s.
PAIRED = (
    ("senses_all", "senses probe, all queries", ("senses", "all")),
    ("senses_heldout", "senses probe, held-out queries", ("senses", "heldout")),
    ("syntax_heldout", "syntax probe, held out", ("syntax", "heldout")),
    ("syntax_ambiguous", "syntax probe, ambiguous words", ("syntax", "ambiguous")),
)


def _verdict(d: dict) -> str:
    if d["ci95"][1] < 0:
        return "worse beyond the noise"
    return "better beyond the noise" if d["ci95"][0] > 0 else "within the noise"


def _value(figures: dict, path: tuple[str, str]) -> str:
    value = figures.get(path[0], {}).get(path[1])
    return "" if value is None else f"{value:.3f} "


def decide(baseline: dict, candidate: dict, noise: dict) -> Decision:
    """The shipping rule (docs/training.md): the candidate replaces the baseline (the default model) when its
    held-out perplexity is >= 30% below the bigram's in each direction, the senses probe (all queries, best upper layer)
    is better than the random-weights control beyond the noise, it is not worse than the baseline beyond the noise
    (the 95% interval of the paired difference wholly below zero) on the senses probe (all and held-out queries) and
    the syntax probe (held-out and ambiguous occurrences), and allennlp agrees with its export within the bar.
    noise: compare()'s. Each reason gives the figure, its interval and whether it is met."""
    conditions = []
    pct = candidate.get("below_bigram")
    if pct is None:
        conditions.append((False, "perplexity against the bigram not measured (give --corpus)"))
    else:
        met = all(pct[d] >= 100 * BELOW_BIGRAM_GOAL for d in ("forward", "backward"))
        ppl, bigram = candidate["perplexity"], candidate["bigram"]
        conditions.append(
            (
                met,
                f"held-out perplexity {ppl['forward']} / {ppl['backward']} against the Kneser-Ney bigram's "
                f"{bigram['forward']} / {bigram['backward']}: {pct['forward']:.1f}% / {pct['backward']:.1f}% below it "
                f"({'meets' if met else 'misses'} >= {100 * BELOW_BIGRAM_GOAL:.0f}%)",
            )
        )
    over_control = candidate.get("noise", {}).get("control", {}).get("senses_all")
    if over_control is None:
        conditions.append((False, "the senses probe against the random-weights control not measured"))
    else:
        met = over_control["ci95"][0] > 0
        control = candidate["control"]["senses"]["all"] if "control" in candidate else None
        conditions.append(
            (
                met,
                f"senses probe, all queries, {_value(candidate, ('senses', 'all'))}against the random-weights "
                f"control's {'' if control is None else f'{control:.3f} '}{over_control['value']:+.3f} (95% interval "
                f"{over_control['ci95'][0]:+.3f} to {over_control['ci95'][1]:+.3f}): {_verdict(over_control)}",
            )
        )
    for key, label, path in PAIRED:
        d = noise[key]
        conditions.append(
            (
                d["ci95"][1] >= 0,
                f"{label} {_value(candidate, path)}against {_value(baseline, path)}{d['value']:+.3f} (95% interval "
                f"{d['ci95'][0]:+.3f} to {d['ci95'][1]:+.3f}): {_verdict(d)}",
            )
        )
    agreement = candidate.get("allennlp")
    if agreement is None:
        conditions.append((False, "allennlp's agreement not measured (give --allennlp)"))
    else:
        within = "within" if agreement["met"] else "over"
        conditions.append(
            (agreement["met"], f"allennlp max abs error {agreement['max_abs_error']:.1e} ({within} {ALLENNLP_BAR:g})")
        )
    return Decision(conditions)


# -- the gate: the shipping rule as a command


def measured(
    folder: Path,
    heldout: list[Path],
    examples: Path,
    corpus: list[Path] | None,
    shared_with: list[Path],
    allennlp: str | None,
    threads: int,
    cache: Path,
    log=print,
) -> tuple[dict, dict]:
    """measure()'s (figures, outcomes) of a model, kept in cache/measured/<its weights' sha256>/: read from there
    when they were measured on the same examples and held-out files with at least what is asked now (the bigram,
    allennlp's agreement), else measured there now (about 10 minutes of one core)."""
    work = cache / "measured" / _sha256(folder / "weights.hdf5")[:16]
    if (work / "figures.json").exists():
        figures, outcomes = load(work / "figures.json")
        if (
            figures["examples"]["sha256"] == _sha256(examples)
            and figures["heldout"] == [str(p) for p in heldout]
            and ("bigram" in figures or not corpus)
            and ("allennlp" in figures or not allennlp)
        ):
            log(f"{folder}: measured before, in {work}")
            return figures, outcomes
    bigram_cache = cache / f"bigram-{_sha256(folder / 'vocab.txt')[:16]}.json"
    return measure(folder, heldout, examples, work, corpus, shared_with, allennlp, threads, cache, bigram_cache, log)


@dataclass(frozen=True)
class Gate:
    """The shipping rule applied: the decision, the report that prints every figure with its interval, and the
    two models' (figures, outcomes)."""

    decision: Decision
    report: str
    baseline: tuple[dict, dict]
    candidate: tuple[dict, dict]


def gate(
    candidate: Path,
    against: Path,
    heldout: list[Path],
    corpus: list[Path],
    examples: Path,
    allennlp: str | None,
    threads: int = 1,
    cache: Path = Path("build/passes"),
    log=print,
) -> Gate:
    """The shipping rule applied to `candidate` against `against` (the model it would replace), each measured (or
    read from the cache)."""
    base = measured(against, heldout, examples, None, [candidate], allennlp, threads, cache, log)
    cand = measured(candidate, heldout, examples, corpus, [against], allennlp, threads, cache, log)
    decision = decide(base[0], cand[0], compare(base, cand))
    lines = [f"gate: {candidate} against {against}"]
    lines += [f"  {'met' if met else 'NOT MET'}: {text}" for met, text in decision.conditions]
    shared = cand[0].get("shared_perplexity")
    if shared and base[0].get("shared_perplexity"):
        theirs = base[0]["shared_perplexity"]
        lines.append(
            f"  (not a condition) perplexity on the {shared['shared_words']:,} words both vocabularies hold: "
            f"{shared['forward']} / {shared['backward']} against {theirs['forward']} / {theirs['backward']}"
        )
    lines.append(f"  noise: {NOISE_METHOD}")
    lines.append(f"verdict: {'SHIP' if decision.ship else 'DO NOT SHIP'} {candidate}")
    return Gate(decision, "\n".join(lines), base, cand)


# The published "Original" ELMo, for scale in the card: its biLM's parameters and its training words.
PUBLISHED_PARAMETERS, PUBLISHED_WORDS = 93.6e6, 1e9


def strengths(figures: dict, log: dict) -> str:
    """The card's "What it is good and bad at", said plainly from the model's measured figures and its log."""
    pct, senses, control = figures["below_bigram"], figures["senses"], figures["control"]["senses"]
    rows = {r["layer"]: r for r in figures["syntax"]["rows"]}
    upper = rows[figures["syntax"]["best_layer"]]
    by_file = log.get("heldout_perplexity_by_file") or {}
    margin = {n: 1 - f["bilm_zero_state"]["forward"] / f["kneser_ney_bigram"]["forward"] for n, f in by_file.items()}
    ranked = sorted(margin, key=margin.get, reverse=True)
    sources = ""
    if len(ranked) >= 6:
        sources = (
            f" It reads {', '.join(ranked[:3])} best (the most below the bigram) and {', '.join(ranked[-3:])} worst."
        )
    coverage = 100 * log["vocab_coverage_heldout"]
    seen = log["tokens_seen"] + log.get("init_tokens_seen", 0)  # a continuation's model saw its --init's words too
    return "\n".join(
        [
            "## What it is good and bad at",
            "",
            f"- Good: it reads English text far better than a bigram model (held-out perplexity "
            f"{pct['forward']:.0f}% / {pct['backward']:.0f}% below the Kneser-Ney bigram's on the same "
            f"vocabulary).{sources}",
            f"- Good: its upper layers carry the part of speech (a linear probe: {upper['accuracy']:.2f} on held-out "
            f"words, {upper['ambiguous_accuracy']:.2f} on words used as several parts of speech, against "
            f"{rows['0']['ambiguous_accuracy']:.2f} from layer 0's spelling alone).",
            f"- Weak: it tells word senses apart only a little better than random weights of its architecture do "
            f"({senses['all']:.3f} of WordNet's sense queries find a same-sense nearest neighbour in layer "
            f"{senses['best_layer']}, against {control['all']:.3f} for random weights and a chance rate of "
            f"{senses['chance']:.3f}).",
            f"- Small: {log['parameters']['bilm'] / 1e6:.1f} M parameters trained on {seen / 1e6:.0f} M "
            f"words, where the published ELMo has {PUBLISHED_PARAMETERS / 1e6:.1f} M trained on "
            f"{PUBLISHED_WORDS / 1e9:.0f} B: it shows and tests the service with real, contextual vectors, and is no "
            "match for the published ELMo on downstream tasks (serve that with elmo-export).",
            f"- English only; its softmax knows {log['vocab_size']:,} words ({coverage:.1f}% of held-out tokens), "
            "though every word is read through its characters. Every sentence starts from the zero state.",
            "",
        ]
    )


def ship(result: Gate, candidate: Path, to: Path, earlier: list[tuple[dict, dict]] = ()) -> None:
    """A released pass that the gate admitted, shipped: its files copied over `to` (the model it replaces), and its
    card given what it is good and bad at, the per-pass table (`earlier` rows first, then the model it replaces and
    itself, each compared with the model it replaces) and the gate's report."""
    if not result.decision.ship:
        raise ValueError(f"the gate refuses {candidate}: nothing shipped")
    copy_released(candidate, to)
    log = json.loads((to / "train_log.json").read_text())
    figures, outcomes = result.baseline
    was = f"pass {figures['pass']}" if figures.get("pass") else f"{figures['model']} before"
    replaced = ({**figures, "model": f"the model it replaced ({was})", "pass": None}, outcomes)
    table = card_section(replaced, [*earlier, replaced, result.candidate])
    with (to / "MODEL_CARD.md").open("a") as f:
        f.write(f"\n{strengths(result.candidate[0], log)}\n{table}\n## The gate\n\n")
        f.write(f"What `python -m training.passes gate` printed when it shipped:\n\n```text\n{result.report}\n```\n")


# -- measuring a model


def measure(
    folder: Path,
    heldout: list[Path],
    examples: Path,
    work: Path | None = None,
    corpus: list[Path] | None = None,
    shared_with: list[Path] | None = None,
    allennlp: str | None = None,
    threads: int = 1,
    cache: Path = Path("build/passes"),
    bigram_cache: Path | None = None,
    log=print,
) -> tuple[dict, dict]:
    """Every figure of one model (an elmo-train folder or passes/N folder): (figures, outcomes), also written to
    work/figures.json and work/outcomes.json."""
    folder, work = Path(folder), Path(work or folder)
    work.mkdir(parents=True, exist_ok=True)
    figures: dict = {"model": str(folder), "pass": pass_number(folder)}
    figures["weights_sha256"] = _sha256(folder / "weights.hdf5")
    log(f"{folder}: held-out perplexity, zero state, own vocabulary")
    figures["perplexity"] = heldout_perplexity(folder, heldout)
    figures["vocabulary"] = len(Vocabulary.load(folder / "vocab.txt"))
    if corpus:
        log("the Kneser-Ney bigram on the same vocabulary and text")
        cache_file = bigram_cache or default_bigram_cache(folder, work)
        figures["bigram"] = bigram_figures(folder / "vocab.txt", corpus, heldout, cache_file)
        figures["below_bigram"] = below(figures["perplexity"], figures["bigram"])
    if shared_with:
        log("perplexity on the shared vocabulary")
        figures["shared_perplexity"] = shared_vocabulary_perplexity(folder, shared_with, heldout)
    log("elmo-export")
    onnx_dir = export(folder, work / "onnx")
    log("training.probes.senses and training.probes.syntax")
    probe_figures, outcomes = probes(onnx_dir, examples, threads)
    figures |= probe_figures
    log("the control: the same architecture with random weights")
    control_figures, control_outcomes = control(folder / "options.json", examples, cache, threads)
    figures["control"] = control_figures
    figures["noise"] = {"method": NOISE_METHOD, "own": own_noise(figures, outcomes)}
    figures["noise"]["control"] = compare((control_figures, control_outcomes), (figures, outcomes))
    if allennlp:
        log("allennlp 2.10.1 against elmo-embed")
        figures["allennlp"] = allennlp_agreement(folder, onnx_dir, heldout, allennlp, threads)
    figures["examples"] = {"path": str(examples), "sha256": _sha256(examples)}
    figures["heldout"] = [str(p) for p in heldout]
    (work / "outcomes.json").write_text(json.dumps(outcomes) + "\n")
    (work / "figures.json").write_text(json.dumps(figures, indent=1) + "\n")
    return figures, outcomes


def load(figures_path: Path) -> tuple[dict, dict]:
    """(figures, outcomes) that measure wrote."""
    figures_path = Path(figures_path)
    return json.loads(figures_path.read_text()), json.loads((figures_path.parent / "outcomes.json").read_text())


# -- the model card's table


def _f(x, digits: int = 3) -> str:
    return "" if x is None else f"{x:.{digits}f}"


def _layers(rows: list[dict], key: str) -> str:
    return " / ".join(_f(r[key]) for r in rows if r["layer"].isdigit())


def name_of(figures: dict) -> str:
    return f"pass {figures['pass']}" if figures.get("pass") else figures["model"]


TABLE_HEADER = [
    "| model | held-out perplexity (fwd / bwd) | Kneser-Ney bigram | below the bigram | shared vocabulary "
    "| senses: all (layer) | senses: held out | senses: layer 0 (chance) | senses control: all / held out "
    "| syntax held out: 0 / 1 / 2 | ambiguous: 0 / 1 / 2 | syntax control: held out / ambiguous (best upper) "
    "| allennlp | vs today's model: senses all; held out; syntax; ambiguous | ship |",
    "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
]


def table_row(figures: dict, noise: dict | None = None, decision: Decision | None = None) -> str:
    """One row of the per-pass table; noise (compare()'s) and decision against today's model, when given."""
    p, s, x = figures["perplexity"], figures["senses"], figures["syntax"]
    bigram = figures.get("bigram")
    pct = figures.get("below_bigram")
    shared = figures.get("shared_perplexity")
    cs, cx = figures["control"]["senses"], figures["control"]["syntax"]
    agreement = figures.get("allennlp")
    versus = ""
    if noise:
        versus = "; ".join(
            f"{noise[k]['value']:+.3f} [{noise[k]['ci95'][0]:+.3f}, {noise[k]['ci95'][1]:+.3f}]"
            for k in ("senses_all", "senses_heldout", "syntax_heldout", "syntax_ambiguous")
        )
    cells = [
        name_of(figures),
        f"{p['forward']} / {p['backward']}",
        f"{bigram['forward']} / {bigram['backward']}" if bigram else "",
        f"{pct['forward']:.1f}% / {pct['backward']:.1f}%" if pct else "",
        f"{shared['forward']} / {shared['backward']} ({shared['shared_words']:,} words)" if shared else "",
        f"{_f(s['all'])} ({s['best_layer']})",
        _f(s["heldout"]),
        f"{_f(s['layer0'])} ({_f(s['rows'][0]['chance'])})",
        f"{_f(cs['all'])} / {_f(cs['heldout'])}",
        _layers(x["rows"], "accuracy"),
        _layers(x["rows"], "ambiguous_accuracy"),
        f"{_f(cx['heldout'])} / {_f(cx['ambiguous'])}",
        f"{agreement['max_abs_error']:.1e}" if agreement else "",
        versus,
        ("yes" if decision.ship else "no") if decision else "",
    ]
    return "| " + " | ".join(cells) + " |"


def card_section(baseline: tuple[dict, dict] | None, rows: list[tuple[dict, dict]]) -> str:
    """The model card's per-pass section: one row per model (today's first, when given), the noise method, and
    the decision for each model against today's."""
    lines = ["## Per pass", "", *TABLE_HEADER]
    decisions = []
    for figures, outcomes in rows:
        if baseline is not None and figures["weights_sha256"] != baseline[0]["weights_sha256"]:
            noise = compare(baseline, (figures, outcomes))
            decision = decide(baseline[0], figures, noise)
            decisions.append(f"- {name_of(figures)}: {decision.describe()}.")
            lines.append(table_row(figures, noise, decision))
        else:
            lines.append(table_row(figures))
    first = rows[0][0]
    s = first["senses"]
    lines += [
        "",
        f"Held-out perplexity: zero initial state, the model's own vocabulary, {first['perplexity']['predictions']:,} "
        "predictions per direction over the held-out files pooled; the Kneser-Ney bigram on the same vocabulary and "
        "text. A model's own-vocabulary figures compare only with models of the same vocabulary (a smaller one has "
        "fewer words to tell apart); the shared-vocabulary column compares any two: the words both models' "
        "vocabularies hold, the rest one class. Senses: "
        f"training.probes.senses, 1-NN same-sense accuracy of the best upper layer on all {s['queries']:,} queries "
        f"and the same layer on the {s['heldout_queries']} held-out synsets' queries; layer 0 against its chance "
        "rate. Syntax: training.probes.syntax, the probe's accuracy per layer on the held-out synsets' occurrences and "
        "those of ambiguous words (the rule compares the best upper layer on held-out occurrences). Control: the same "
        "architecture with random weights. allennlp: max abs error of allennlp 2.10.1's _ElmoBiLm against "
        "elmo-embed on the export, 200 held-out sentences, every layer.",
        "",
        f"Noise: {NOISE_METHOD}. The differences are (model - today's) with their 95% interval.",
    ]
    if decisions:
        lines += ["", "Decision (the shipping rule, training.passes.decide):", "", *decisions]
    return "\n".join(lines) + "\n"


# -- printing


def _row(*cells) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def _interval(d: dict, sign: str = "") -> str:
    return f"{d['value']:{sign}.4f} +- {d['se']:.4f} (95% {d['ci95'][0]:{sign}.4f} to {d['ci95'][1]:{sign}.4f})"


def describe(figures: dict) -> str:
    """Every figure of measure(), as text."""
    p = figures["perplexity"]
    lines = [figures["model"] + (f" (pass {figures['pass']})" if figures.get("pass") else "")]
    lines.append(
        f"held-out perplexity, zero state, own vocabulary ({figures['vocabulary']:,} words), "
        f"{p['predictions']:,} predictions: forward {p['forward']}, backward {p['backward']}"
    )
    bigram = figures.get("bigram")
    if bigram:
        pct = figures["below_bigram"]
        lines.append(
            f"Kneser-Ney bigram, same vocabulary and text: forward {bigram['forward']}, backward "
            f"{bigram['backward']} -> {pct['forward']:.2f}% / {pct['backward']:.2f}% below it (goal >= 30%)"
        )
    lines.append(_row("held out", "predictions", "forward", "backward", *(["bigram fwd", "bwd"] if bigram else [])))
    for name, f in p["by_file"].items():
        extra = [bigram["by_file"][name]["forward"], bigram["by_file"][name]["backward"]] if bigram else []
        lines.append(_row(name, f"{f['predictions']:,}", f["forward"], f["backward"], *extra))
    if "shared_perplexity" in figures:
        sh = figures["shared_perplexity"]
        by_file = ", ".join(f"{n} {f['forward']} / {f['backward']}" for n, f in sh["by_file"].items())
        lines.append(
            f"on the {sh['shared_words']:,} words shared with {', '.join(sh['with'])}: forward {sh['forward']}, "
            f"backward {sh['backward']}; by file: {by_file}"
        )
    for title, fig in (("model", figures), ("control (random weights)", figures["control"])):
        s, x = fig["senses"], fig["syntax"]
        lines.append(f"training.probes.senses, {title}: {s['queries']} queries ({s['heldout_queries']} held out)")
        lines.append(_row("layer", "all", "chance", "tie-break sd", "held-out queries", "chance"))
        for r in s["rows"]:
            tie = f"{r['tie_break']['sd']:.4f}" if "tie_break" in r else ""
            lines.append(
                _row(
                    r["layer"],
                    _f(r["accuracy"]),
                    _f(r["chance"]),
                    tie,
                    _f(r["heldout_accuracy"]),
                    _f(r["heldout_chance"]),
                )
            )
        lines.append(
            f"training.probes.syntax, {title}: {x['test']} held-out occurrences, {x['ambiguous_test']} ambiguous"
        )
        lines.append(_row("layer", "held out", "majority", "ambiguous", "majority"))
        for r in x["rows"]:
            lines.append(
                _row(
                    r["layer"],
                    _f(r["accuracy"]),
                    _f(r["majority"]),
                    _f(r["ambiguous_accuracy"]),
                    _f(r["ambiguous_majority"]),
                )
            )
    noise = figures["noise"]
    lines.append(f"noise: {noise['method']}")
    for k, d in noise["own"].items():
        lines.append(f"  {k}: {_interval(d)}; {d['items']} items, {d['clusters']} words")
    for k, d in noise["control"].items():
        if k != "method":
            lines.append(f"  over the control, {k}: {_interval(d, '+')}")
    if "allennlp" in figures:
        a = figures["allennlp"]
        lines.append(
            f"allennlp 2.10.1 _ElmoBiLm vs elmo-embed, {a['sentences']} held-out sentences ({a['tokens']} tokens), "
            f"every layer: max abs error {a['max_abs_error']:.2e} ({'meets' if a['met'] else 'misses'} "
            f"<= {a['bar']:g})"
        )
    return "\n".join(lines)


def pass_state(folder: Path, checkpoint: Path | None = None, log: Path | None = None) -> dict:
    """Where the run stood at the end of pass N (`folder`: OUT/passes/N/): its state.json, written with the pass; or,
    for a pass written before there was one, taken from the run's checkpoint (the history up to that pass) and its
    log ("epoch N/E: ... (M min of training so far)")."""
    if (folder / PASS_STATE).exists():
        return json.loads((folder / PASS_STATE).read_text())
    number = pass_number(folder)
    if number is None or checkpoint is None or log is None:
        raise ValueError(f"{folder} has no {PASS_STATE}: give the run's checkpoint and log to take it from")
    saved = torch.load(checkpoint, weights_only=False, map_location="cpu")
    epochs = saved["history"]["epochs"]
    if len(epochs) < number:
        raise ValueError(f"{checkpoint} holds {len(epochs)} finished passes, not pass {number}")
    end = epochs[number - 1]
    minutes = re.findall(rf"epoch {number}/\d+: held-out perplexity[^(]*\(([\d.]+) min of training so far\)",
                         Path(log).read_text(errors="replace"))  # fmt: skip
    if not minutes:
        raise ValueError(f"{log} does not say when pass {number} ended")
    history = {"loss": [h for h in saved["history"]["loss"] if h["step"] <= end["step"]], "epochs": epochs[:number]}
    return {"epoch": number, "step": end["step"], "tokens": end["tokens"], "train_seconds": 60 * float(minutes[-1]),
            "history": history, "config": saved["config"]}  # fmt: skip


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    m = sub.add_parser("measure", help="every figure of one model (a passes/N folder or an elmo-train folder)")
    m.add_argument("model", type=Path, help="options.json, weights.hdf5, vocab.txt, softmax.hdf5")
    m.add_argument("--work", type=Path, help="where figures.json, outcomes.json and onnx/ go (default: the model's)")
    m.add_argument("--shared-with", nargs="*", default=[], type=Path, help="folders (or vocab.txt files) whose "
                   "vocabulary joins the shared-vocabulary perplexity")  # fmt: skip
    m.add_argument("--bigram-cache", type=Path, help="default: passes/bigram.json beside the passes")
    m.add_argument("--baseline", type=Path, help="figures.json of today's model: compare and decide")
    g = sub.add_parser("gate", help="the shipping rule: may CANDIDATE replace --against? (exit 1 if not)")
    s = sub.add_parser("ship", help="the gate, then CANDIDATE (a released pass) copied over --against, card and all")
    for command in (g, s):
        command.add_argument("candidate", type=Path, help="a model folder: options.json, weights.hdf5, vocab.txt, "
                             "softmax.hdf5")  # fmt: skip
        command.add_argument("--against", type=Path, default=Path("models/default"), help="the model it replaces")
    s.add_argument("--table", nargs="*", default=[], type=Path, help="figures.json of earlier models: the first "
                   "rows of the card's per-pass table")  # fmt: skip
    for command in (m, g, s):
        command.add_argument("--heldout", nargs="+", required=True, type=Path, help="the run's held-out files")
        command.add_argument("--corpus", nargs="+", type=Path, help="the run's training files (the bigram's text)")
        command.add_argument("--examples", type=Path, default=Path("build/corpus-all/examples.jsonl"))
        command.add_argument("--allennlp", help="the python of allennlp 2.10.1's environment "
                             "(bench/allennlp_baseline.py)")  # fmt: skip
        command.add_argument("--threads", type=int, default=1, help="torch and ONNX Runtime threads (default 1)")
        command.add_argument("--cache", type=Path, default=Path("build/passes"), help="where the control is kept "
                             "(and, for gate, every model's figures)")  # fmt: skip
    t = sub.add_parser("table", help="the model card's per-pass section from figures.json files")
    t.add_argument("figures", nargs="+", type=Path)
    t.add_argument("--baseline", type=Path, help="figures.json of today's model: each row compared with it")
    t.add_argument("--out", type=Path, help="also write the section here")
    r = sub.add_parser("release", help="a pass as a finished run's folder (train_log.json, card, curve), to ship it")
    r.add_argument("model", type=Path, help="OUT/passes/N/")
    r.add_argument("--corpus", nargs="+", required=True, type=Path, help="the run's training files")
    r.add_argument("--heldout", nargs="+", required=True, type=Path, help="the run's held-out files")
    r.add_argument("--config", required=True, help="the run's --config (its description goes into the card)")
    r.add_argument("--checkpoint", type=Path, help="the run's checkpoint, for a pass without state.json")
    r.add_argument("--log", type=Path, help="the run's log, for a pass without state.json")
    r.add_argument("--table", nargs="*", default=[], type=Path, help="figures.json files: the card's per-pass table")
    r.add_argument("--baseline", type=Path, help="figures.json of the model it replaces")
    r.add_argument("--to", type=Path, help="then copy the released files here (models/NAME), replacing what is there")
    return parser


def _progress(message: str) -> None:
    print(f"-- {message}", flush=True)


def _release(args) -> int:
    state = pass_state(args.model, args.checkpoint, args.log)
    rows = [load(p) for p in args.table]
    card = card_section(load(args.baseline) if args.baseline else None, rows) if rows else ""
    log = release_pass(args.model, args.corpus, args.heldout, args.config, state, args.to, card)
    ppl = log["heldout_perplexity"]["bilm_zero_state"]
    where = f"{args.model} and {args.to}" if args.to else str(args.model)
    print(f"wrote {where}: held-out perplexity forward {ppl['forward']}, backward {ppl['backward']}")
    return 0


def _measure(args) -> int:
    figures, outcomes = measure(args.model, args.heldout, args.examples, args.work, args.corpus, args.shared_with,
                                args.allennlp, args.threads, args.cache, args.bigram_cache, log=_progress)  # fmt: skip
    print(describe(figures))
    if args.baseline:
        baseline = load(args.baseline)
        noise = compare(baseline, (figures, outcomes))
        decision = decide(baseline[0], figures, noise)
        work = Path(args.work or args.model)
        verdict = {"baseline": str(args.baseline), "noise": noise, "ship": decision.ship, "reasons": decision.reasons}
        (work / "decision.json").write_text(json.dumps(verdict, indent=1) + "\n")
        (work / "card.md").write_text(card_section(baseline, [baseline, (figures, outcomes)]))
        print(f"against {args.baseline}: {decision.describe()}")
    return 0


def _gate(args) -> int:
    if not args.corpus:
        raise SystemExit(f"{args.command}: give --corpus (the bigram's text): the rule compares with the bigram")
    result = gate(args.candidate, args.against, args.heldout, args.corpus, args.examples, args.allennlp,
                  args.threads, args.cache, log=_progress)  # fmt: skip
    print(result.report)
    if not result.decision.ship:
        return 1
    if args.command == "ship":
        ship(result, args.candidate, args.against, [load(p) for p in args.table])
        print(f"shipped {args.candidate} to {args.against}: now `make default-export` (docs/training.md)")
    return 0


def _table(args) -> int:
    rows = [load(p) for p in args.figures]
    section = card_section(load(args.baseline) if args.baseline else None, rows)
    print(section, end="")
    if args.out:
        args.out.write_text(section)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    torch.set_num_threads(getattr(args, "threads", None) or torch.get_num_threads())
    commands = {"release": _release, "measure": _measure, "gate": _gate, "ship": _gate, "table": _table}
    return commands[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
