"""The embedded default model as committed: within its size budget, complete, and loadable in the published layout."""

import json
from pathlib import Path

import numpy as np

from model_export.export import torch_layers
from model_export.weights import load_bilm
from training.vocab import Vocabulary

DEFAULT = Path(__file__).resolve().parents[2] / "models" / "default"
BUDGET_BYTES = 20 * 1000 * 1000


def test_size_budget_and_files():
    files = {p.name: p.stat().st_size for p in DEFAULT.iterdir()}
    assert {"options.json", "weights.hdf5", "vocab.txt", "softmax.hdf5", "MODEL_CARD.md", "training_curve.png"} <= set(
        files
    )
    assert sum(files.values()) <= BUDGET_BYTES, files


def test_loads_in_the_published_layout_with_a_real_architecture():
    bilm = load_bilm(DEFAULT / "options.json", DEFAULT / "weights.hdf5")
    opt = bilm.options
    assert opt.n_layers >= 2 and opt.skip_connections and opt.proj_dim < opt.cell_dim
    (layers,) = torch_layers(bilm, [["The", "bank", "of", "the", "river", "."]])
    assert layers.shape == (opt.n_layers + 1, 6, opt.output_dim) and np.isfinite(layers).all()
    assert len(Vocabulary.load(DEFAULT / "vocab.txt")) == 32000


def test_model_card_reports_the_training_log():
    card = (DEFAULT / "MODEL_CARD.md").read_text()
    log = json.loads((DEFAULT / "train_log.json").read_text())
    ppl = log["heldout_perplexity"]
    for row, key in [("zero initial state", "bilm_zero_state"), ("warm initial state", "bilm_warm_state"),
                     ("Kneser-Ney bigram", "kneser_ney_bigram")]:  # fmt: skip
        assert f"{row}" in card and f"| {ppl[key]['forward']} | {ppl[key]['backward']} |" in card, row
    assert f"{log['steps']} steps" in card and f"{log['train_seconds'] / 60:.1f} min" in card
    assert f"{log['train_tokens']:,} tokens" in card
