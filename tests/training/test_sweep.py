"""training.sweep: candidate configs trained for the same steps, ranked by held-out perplexity."""

from __future__ import annotations

import json
from dataclasses import asdict, replace
from pathlib import Path

from tests.training.toy import write_corpus
from training.trainer import load_config, train


def test_sweep_ranks_configs_by_held_out_perplexity_and_sizes_the_winner(corpus, tmp_path):
    """Two architectures trained for the same steps; the winner's checkpoint is there to continue, and the epochs
    that fit in a budget are computed from its measured rate."""
    from training.sweep import sweep

    _, opt, cfg = load_config("tiny")
    smaller = tmp_path / "tinier.json"
    tinier = opt.to_dict()
    tinier["lstm"] |= {"dim": 4, "projection_dim": 4}
    smaller.write_text(json.dumps({"options": tinier, "training": asdict(replace(cfg, warmup_steps=40))}))
    held = write_corpus(tmp_path / "held.txt", 40, seed=5)
    s = sweep([corpus], [held], ["tiny", str(smaller)], tmp_path / "sweep", steps=30, budget_minutes=1)
    assert set(s["results"]) == {"tiny", str(smaller)} and s["best"] == "tiny"
    for r in s["results"].values():
        assert r["steps"] == 30 and r["tokens_per_second"] > 0
    assert s["results"]["tiny"]["bilm_parameters"] > s["results"][str(smaller)]["bilm_parameters"]
    assert s["epochs_in_budget"] >= 1 and s["steps_per_epoch"] == 21  # as many as training makes
    assert json.loads((tmp_path / "sweep" / "sweep.json").read_text()) == s
    resumed = train([corpus], Path(s["results"]["tiny"]["out"]), "tiny", heldout=[held], epochs=1)
    assert resumed["finished"] and resumed["steps"] == 30  # 30 steps past one epoch already: nothing more to do
