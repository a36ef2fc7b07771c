"""MODEL_CARD.md (training.model_card) as a run writes it: the corpus's sources and licences."""

from __future__ import annotations

import json

from training.trainer import train


def test_the_model_card_states_the_corpus_sources_and_licences(corpus, tmp_path):
    """Text from python -m training.corpus --sources: its manifest's sources and licences go into the card."""
    (tmp_path / "c" / "train").mkdir(parents=True)
    text = tmp_path / "c" / "train" / "toy.txt"
    text.write_text(corpus.read_text())
    manifest = {"sources": {"toy": {"packages": {"toy-pkg": "1.0"}, "license": "public domain",
                                    "train": {"tokens": 123}}}}  # fmt: skip
    (tmp_path / "c" / "manifest.json").write_text(json.dumps(manifest))
    log = train([text], tmp_path / "out", "tiny", epochs=1)
    assert log["sources"] == {"toy": {"packages": {"toy-pkg": "1.0"}, "license": "public domain", "train_tokens": 123}}
    assert "| toy | toy-pkg (1.0) | public domain | 123 |" in (tmp_path / "out" / "MODEL_CARD.md").read_text()
