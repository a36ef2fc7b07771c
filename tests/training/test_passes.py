"""training.passes: every figure of a pass of the tiny run (seconds), the bigram's cache, the noise (the paired
cluster bootstrap), the shipping rule and the model card's table."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

import training.passes as passes
from training.passes import (
    Decision,
    bigram_figures,
    card_section,
    cluster_bootstrap,
    decide,
    load,
    main,
    measure,
    pass_number,
)
from training.trainer import HELDOUT_EVERY
from training.vocab import Vocabulary

# WordNet's layout in examples.jsonl, in the toy language: "cat" in three noun synsets (one held out), "sat" in
# two verb synsets and a noun one, "red" an adjective (one held out): senses and parts of speech to tell apart.
EXAMPLES = [
    ("n01", ["cat"], ["the cat sat on the mat", "a cat ran under a rug", "the big cat sat on a mat"], "train"),
    ("n02", ["cat"], ["a small cat ran on the rug", "the red cat sat under the mat"], "train"),
    ("n03", ["cat"], ["a cat sat quickly on a rug", "the cat ran slowly under the rug"], "heldout"),
    ("v04", ["sat"], ["the dog sat on the mat", "a dog sat under a rug"], "train"),
    ("v05", ["sat"], ["the big dog sat slowly on a rug", "a red dog sat on the mat"], "heldout"),
    ("n06", ["sat"], ["the sat on the mat", "a sat under a rug"], "train"),
    ("a07", ["red"], ["the red dog ran on a mat", "a red cat ran under the rug"], "train"),
    ("s08", ["red"], ["a red dog sat quickly on the rug", "the red cat ran on a mat"], "heldout"),
]

# A stand-in for allennlp's environment: bench/allennlp_baseline.py's interface, answered by the project's
# PyTorch biLM (the reference the export is checked against), so the agreement's plumbing is tested here.
STAND_IN = """
import sys
sys.path.insert(0, {repo!r})
import argparse, h5py
from model_export.export import torch_layers
from model_export.weights import load_bilm
p = argparse.ArgumentParser()
for flag in ("--options", "--weights", "--input", "--output", "--batch-size", "--threads"):
    p.add_argument(flag)
p.add_argument("--stateless", action="store_true")
a = p.parse_args()
sentences = [line.split() for line in open(a.input)]
layers = torch_layers(load_bilm(a.options, a.weights), sentences)
with h5py.File(a.output, "w") as f:
    for i, x in enumerate(layers):
        f.create_dataset(str(i), data=x)
"""


@pytest.fixture(scope="module")
def examples(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("examples") / "examples.jsonl"
    lines = [
        json.dumps({"synset": synset, "lemmas": lemmas, "tokens": text.split(), "split": split})
        for synset, lemmas, texts, split in EXAMPLES
        for text in texts
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def split(corpus, tmp_path_factory) -> tuple[Path, Path]:
    """The tiny run's training and held-out text as files, split as elmo-train split it (no --heldout)."""
    lines = [line for line in corpus.read_text().splitlines() if line.strip()]
    folder = tmp_path_factory.mktemp("split")
    (folder / "train.txt").write_text("\n".join(x for i, x in enumerate(lines) if i % HELDOUT_EVERY != 49) + "\n")
    (folder / "heldout.txt").write_text("\n".join(x for i, x in enumerate(lines) if i % HELDOUT_EVERY == 49) + "\n")
    return folder / "train.txt", folder / "heldout.txt"


@pytest.fixture(scope="module")
def measured(trained, split, examples, tmp_path_factory) -> dict:
    """Passes 1 and 3 of the tiny run measured (pass 3 with the allennlp stand-in), into work folders."""
    out, _ = trained
    work = tmp_path_factory.mktemp("work")
    stand_in = work / "stand_in.py"
    stand_in.write_text(STAND_IN.format(repo=str(passes.REPO)))
    passes.ALLENNLP_SCRIPT = stand_in
    try:
        results = {}
        for n in (1, 3):
            results[n] = measure(
                out / "passes" / str(n), [split[1]], examples, work=work / str(n), corpus=[split[0]],
                shared_with=[out / "passes" / "1"], allennlp=sys.executable if n == 3 else None,
                cache=work / "cache", log=lambda _: None,
            )  # fmt: skip
    finally:
        passes.ALLENNLP_SCRIPT = passes.REPO / "bench" / "allennlp_baseline.py"
    return {"work": work, "results": results, "out": out}


def test_perplexity_is_elmo_trains_and_the_bigram_is_the_runs(measured, trained):
    _, log = trained
    figures = {n: f for n, (f, _) in measured["results"].items()}
    epochs = log["history"]["epochs"]
    for n in (1, 3):
        assert figures[n]["perplexity"]["forward"] == pytest.approx(epochs[n - 1]["forward"], abs=0.01)
        assert figures[n]["perplexity"]["backward"] == pytest.approx(epochs[n - 1]["backward"], abs=0.01)
        assert figures[n]["pass"] == n
    ppl = log["heldout_perplexity"]
    assert figures[3]["perplexity"]["forward"] == ppl["bilm_zero_state"]["forward"]
    assert figures[3]["perplexity"]["predictions"] == ppl["bilm_zero_state"]["predictions"]
    assert {d: figures[3]["bigram"][d] for d in ("forward", "backward")} == ppl["kneser_ney_bigram"]
    below = figures[3]["below_bigram"]["forward"]
    bilm, bigram = ppl["bilm_zero_state"]["forward"], ppl["kneser_ney_bigram"]["forward"]
    assert below == pytest.approx(100 * (1 - bilm / bigram), abs=0.01)
    shared = figures[3]["shared_perplexity"]
    assert shared["shared_words"] == len(Vocabulary.load(measured["out"] / "vocab.txt"))  # the same vocabulary
    assert shared["forward"] == pytest.approx(figures[3]["perplexity"]["forward"], rel=1e-3)


def test_probes_control_noise_and_agreement(measured):
    figures, outcomes = measured["results"][3]
    work = measured["work"] / "3"
    assert (work / "onnx" / "manifest.json").exists()
    assert json.loads((work / "figures.json").read_text()) == json.loads(json.dumps(figures))
    assert load(work / "figures.json") == (json.loads(json.dumps(figures)), json.loads(json.dumps(outcomes)))
    s = figures["senses"]
    assert [r["layer"] for r in s["rows"]] == ["0", "1", "2", "mean of 1..2"]
    assert s["best_layer"] in ("1", "2") and s["all"] == max(r["accuracy"] for r in s["rows"][1:3])
    assert s["queries"] == len(outcomes["senses"]["layers"]["0"]["all"]["hit"]) > s["heldout_queries"] > 0
    assert s["rows"][0]["tie_break"]["seeds"] == passes.TIE_SEEDS
    assert figures["syntax"]["test"] == len(outcomes["syntax"]["test"]) == 6
    assert set(figures["control"]) == {"senses", "syntax"}
    assert (measured["work"] / "cache").is_dir() and len(list((measured["work"] / "cache").iterdir())) == 1
    for key in ("senses_all", "senses_heldout", "syntax_heldout", "syntax_ambiguous", "senses_layer0_minus_chance"):
        d = figures["noise"]["own"][key]
        assert d["ci95"][0] <= d["value"] <= d["ci95"][1] and d["se"] >= 0
    assert figures["noise"]["control"]["method"] == passes.NOISE_METHOD
    agreement = figures["allennlp"]
    assert agreement["met"] and agreement["max_abs_error"] <= 1e-5 and agreement["sentences"] == 24
    assert "allennlp" not in measured["results"][1][0]


def test_the_bigram_is_computed_once(tmp_path, trained, split, monkeypatch):
    out, _ = trained
    cache = tmp_path / "bigram.json"
    first = bigram_figures(out / "vocab.txt", [split[0]], [split[1]], cache)
    monkeypatch.setattr(passes, "bigram_perplexities", lambda *a: pytest.fail("computed again"))
    assert bigram_figures(out / "vocab.txt", [split[0]], [split[1]], cache) == first
    other = tmp_path / "vocab.txt"
    other.write_text((out / "vocab.txt").read_text() + "zebra\n")  # another vocabulary: computed again
    with pytest.raises(pytest.fail.Exception, match="computed again"):
        bigram_figures(other, [split[0]], [split[1]], cache)


def test_pass_number(tmp_path):
    assert pass_number(Path("build/train-cpu/passes/2")) == 2
    assert pass_number(tmp_path) is None  # a finished run's folder, or a published model
    (tmp_path / "state.json").write_text(json.dumps({"epoch": 3, "step": 12261}))
    assert pass_number(tmp_path) == 3  # a pass released elsewhere (models/cpu-base)


def test_cluster_bootstrap_is_paired_and_resamples_whole_clusters():
    rng = np.random.default_rng(0)
    a = rng.integers(0, 2, 400).tolist()
    same = cluster_bootstrap(a, a, [str(i) for i in range(400)])
    assert same["value"] == 0 and same["se"] == 0 and same["ci95"] == [0, 0]
    assert cluster_bootstrap(a, None, list(range(400))) == cluster_bootstrap(a, None, list(range(400)))  # seeded
    better = cluster_bootstrap([1] * 400, a, list(range(400)))
    assert better["ci95"][0] > 0 and better["value"] == pytest.approx(1 - np.mean(a))
    # 40 words of 10 queries each, all of a word's queries alike: 40 independent items, not 400
    alike = np.repeat(rng.integers(0, 2, 40), 10).tolist()
    per_item = cluster_bootstrap(alike, None, list(range(400)))
    per_word = cluster_bootstrap(alike, None, np.repeat(np.arange(40), 10).tolist())
    assert per_word["clusters"] == 40 and per_word["se"] > 2.5 * per_item["se"]


def _noise(value: float, low: float, high: float) -> dict:
    return {"value": value, "se": 0.01, "ci95": [low, high]}


def test_decide_ships_only_when_every_criterion_holds():
    candidate = {
        "below_bigram": {"forward": 31.0, "backward": 30.5},
        "perplexity": {"forward": 100.0, "backward": 101.0},
        "bigram": {"forward": 145.0, "backward": 145.3},
        "senses": {"all": 0.437, "heldout": 0.396},
        "control": {"senses": {"all": 0.394}},
        "noise": {"control": {"senses_all": _noise(0.043, 0.03, 0.05)}},
        "allennlp": {"max_abs_error": 5e-6, "met": True},
    }
    baseline = {"senses": {"all": 0.424, "heldout": 0.396}}
    within = {k: _noise(-0.005, -0.02, 0.01) for k in ("senses_all", "senses_heldout", "syntax_heldout")}
    noise = within | {"syntax_ambiguous": _noise(0.03, 0.01, 0.05)}
    decision = decide(baseline, candidate, noise)
    assert decision.ship and len(decision.reasons) == 7 and all(met for met, _ in decision.conditions)
    assert decision.reasons[0].startswith("held-out perplexity 100.0 / 101.0 against the Kneser-Ney bigram's 145.0")
    assert "0.437 against the random-weights control's 0.394 +0.043" in decision.reasons[1]
    assert "senses probe, all queries 0.437 against 0.424 -0.005" in decision.reasons[2]
    assert "within the noise" in decision.reasons[2] and "better beyond the noise" in decision.reasons[5]
    worse = decide(baseline, candidate, noise | {"senses_heldout": _noise(-0.05, -0.09, -0.01)})
    assert not worse.ship and "senses probe, held-out queries 0.396 against 0.396 -0.050" in worse.describe()
    assert "worse beyond the noise" in worse.describe() and not worse.conditions[3][0]
    short = decide(baseline, candidate | {"below_bigram": {"forward": 29.9, "backward": 30.5}}, noise)
    assert not short.ship and "misses >= 30%" in short.reasons[0]
    # the senses probe no better than random weights of the same architecture: not shipped, whatever the rest
    level = candidate | {"noise": {"control": {"senses_all": _noise(0.01, -0.005, 0.025)}}}
    assert not decide(baseline, level, noise).ship and not decide(baseline, level, noise).conditions[1][0]
    unmeasured = {k: candidate[k] for k in ("below_bigram", "perplexity", "bigram", "noise")}
    assert not decide(baseline, unmeasured, noise).ship  # allennlp not measured


def test_table_compares_each_pass_with_todays_model(measured, capsys, tmp_path):
    work = measured["work"]
    main(["table", str(work / "1" / "figures.json"), str(work / "3" / "figures.json"),
          "--baseline", str(work / "1" / "figures.json"), "--out", str(tmp_path / "table.md")])  # fmt: skip
    printed = capsys.readouterr().out
    assert printed == (tmp_path / "table.md").read_text()
    rows = [line for line in printed.splitlines() if line.startswith("| pass ")]
    assert len(rows) == 2 and rows[0].endswith("|  |  |")  # today's model is not compared with itself
    assert rows[1].endswith("| yes |") or rows[1].endswith("| no |")
    assert "- pass 3: " in printed and "paired cluster bootstrap" in printed
    section = card_section(None, [measured["results"][3]])
    assert section.startswith("## Per pass") and "Decision" not in section


def test_measure_cli_compares_with_a_baseline(measured, split, examples, capsys):
    out, work = measured["out"], measured["work"]
    code = main(["measure", str(out / "passes" / "2"), "--heldout", str(split[1]), "--corpus", str(split[0]),
                 "--examples", str(examples), "--work", str(work / "2"), "--cache", str(work / "cache"),
                 "--baseline", str(work / "1" / "figures.json")])  # fmt: skip
    printed = capsys.readouterr().out
    assert code == 0 and "held-out perplexity, zero state" in printed and "training.probes.senses, model" in printed
    # allennlp's agreement was not measured, so the rule cannot ship it
    assert "do not ship" in printed and "allennlp's agreement not measured" in printed
    decision = json.loads((work / "2" / "decision.json").read_text())
    assert decision["ship"] is False and decision["noise"]["method"] == passes.NOISE_METHOD
    assert any("allennlp's agreement not measured" in reason for reason in decision["reasons"])
    assert "| pass 2 |" in (work / "2" / "card.md").read_text()


def test_a_pass_is_released_as_a_finished_run_to_ship(trained, corpus, tmp_path):
    """`release`: a pass of a 3-pass run as the folder a finished run writes, in place (evaluated, train_log.json,
    the card saying which pass of how many, the curve), with the same weights; its state from state.json, or for a
    pass written before there was one, from the run's checkpoint and log."""
    import shutil

    import h5py
    import torch

    from training.passes import pass_state
    from training.trainer import PASS_STATE, release_pass

    out, final = trained
    one = tmp_path / "1"
    shutil.copytree(out / "passes" / "1", one)
    state = json.loads((one / PASS_STATE).read_text())
    assert state["epoch"] == 1 and state["history"]["epochs"] == final["history"]["epochs"][:1]
    log = release_pass(one, [corpus], None, "tiny", state, card="## Per pass\n\nthe table\n")
    assert log["passes"] == 1 and log["steps"] == final["history"]["epochs"][0]["step"]
    card = (one / "MODEL_CARD.md").read_text()
    assert "1 of the 3 epochs of its schedule" in card and card.endswith("## Per pass\n\nthe table\n")
    assert (one / "training_curve.png").read_bytes()[:4] == b"\x89PNG"
    with h5py.File(out / "passes" / "1" / "weights.hdf5") as a, h5py.File(one / "weights.hdf5") as b:
        name = "RNN_0/RNN/MultiRNNCell/Cell0/LSTMCell/W_0"
        np.testing.assert_array_equal(a[name][...], b[name][...])
    # a pass written without state.json: the checkpoint's history up to it, and the time from the run's log
    (one / PASS_STATE).unlink()
    with pytest.raises(ValueError, match="give the run's checkpoint and log"):
        pass_state(one)
    run_log = tmp_path / "train.log"
    run_log.write_text("epoch 1/3: held-out perplexity forward 9.9, backward 9.8 (1.5 min of training so far)\n")
    passes_dir = tmp_path / "passes" / "1"
    shutil.copytree(one, passes_dir)
    rebuilt = pass_state(passes_dir, out / "checkpoint.pt", run_log)
    checkpoint = torch.load(out / "checkpoint.pt", weights_only=False)
    assert rebuilt["step"] == state["step"] and rebuilt["train_seconds"] == 90.0
    assert rebuilt["history"]["epochs"] == checkpoint["history"]["epochs"][:1]
    assert all(h["step"] <= state["step"] for h in rebuilt["history"]["loss"])


def test_gate_prints_every_condition_and_exits_1_when_one_fails(measured, trained, split, examples, capsys):
    """`gate`: both models measured once into the cache (a second gate reads them back), each condition printed
    with its figure and interval, exit 0 only when all hold. Pass 3 against pass 1 on the toy run: the tiny model
    is no better than its bigram, so it may not ship; the same rule against itself fails on the same condition."""
    out, work = measured["out"], measured["work"]
    passes.ALLENNLP_SCRIPT = work / "stand_in.py"
    try:
        argv = ["gate", str(out / "passes" / "3"), "--against", str(out / "passes" / "1"), "--heldout", str(split[1]),
                "--corpus", str(split[0]), "--examples", str(examples), "--cache", str(work / "gate"),
                "--allennlp", sys.executable]  # fmt: skip
        code = main(argv)
        first = capsys.readouterr().out
        assert main(argv) == code
        again = capsys.readouterr().out
    finally:
        passes.ALLENNLP_SCRIPT = passes.REPO / "bench" / "allennlp_baseline.py"
    report = first[first.index("gate: ") :]
    lines = report.splitlines()
    assert lines[0] == f"gate: {out / 'passes' / '3'} against {out / 'passes' / '1'}"
    conditions = [line for line in lines if line.startswith(("  met: ", "  NOT MET: "))]
    assert len(conditions) == 7 and "95% interval" in conditions[2] and "allennlp max abs error" in conditions[6]
    failed = [line for line in conditions if line.startswith("  NOT MET")]
    assert (code == 1) == bool(failed) and lines[-1] == ("verdict: DO NOT SHIP " if failed else "verdict: SHIP ") + str(
        out / "passes" / "3"
    )
    assert "measured before" in again and again[again.index("gate: ") :] == report
    measured_dirs = sorted(p.name for p in (work / "gate" / "measured").iterdir())
    assert len(measured_dirs) == 2


def test_ship_copies_the_admitted_pass_over_the_model_with_its_table_and_the_gate(measured, trained, tmp_path):
    """`ship`: what the gate admitted replaces the model it was measured against (every released file), and its
    card gets the per-pass table and the gate's report; what the gate refused ships nothing."""
    from training.passes import Gate, ship
    from training.trainer import copy_released

    out, results = measured["out"], measured["results"]
    released, default = tmp_path / "released", tmp_path / "default"
    copy_released(out / "passes" / "3", released)
    (released / "MODEL_CARD.md").write_text("# the released pass's card\n")
    (released / "train_log.json").write_text(json.dumps(trained[1]))
    copy_released(out / "passes" / "1", default)
    before = (default / "weights.hdf5").read_bytes()
    refused = Gate(Decision([(True, "perplexity"), (False, "senses")]), "verdict: DO NOT SHIP", results[1], results[3])
    with pytest.raises(ValueError, match="the gate refuses"):
        ship(refused, released, default)
    assert (default / "weights.hdf5").read_bytes() == before and not (default / "MODEL_CARD.md").exists()
    admitted = Gate(Decision([(True, "every condition")]), "gate: ...\nverdict: SHIP", results[1], results[3])
    ship(admitted, released, default)
    assert (default / "weights.hdf5").read_bytes() == (released / "weights.hdf5").read_bytes() != before
    assert (default / "state.json").read_text() == (released / "state.json").read_text()
    card = (default / "MODEL_CARD.md").read_text()
    assert card.startswith("# the released pass's card\n") and "## Per pass" in card and "| pass 3 |" in card
    assert "| the model it replaced (pass 1) |" in card
    good_and_bad = card[card.index("## What it is good and bad at") : card.index("## Per pass")]
    pct = results[3][0]["below_bigram"]
    assert f"held-out perplexity {pct['forward']:.0f}% / {pct['backward']:.0f}% below" in good_and_bad
    assert f"{results[3][0]['senses']['all']:.3f} of WordNet's sense queries" in good_and_bad
    assert card.endswith("## The gate\n\nWhat `python -m training.passes gate` printed when it shipped:\n\n"
                         "```text\ngate: ...\nverdict: SHIP\n```\n")  # fmt: skip
