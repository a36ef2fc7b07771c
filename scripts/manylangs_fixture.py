"""Writes tests/fixtures/elmoformanylangs-tiny: a tiny ELMoForManyLangs model with random weights in that
package's layout (model_export/manylangs.py) and the sentences its reference numbers are computed on. Run in the
project's environment; then scripts/manylangs_reference.py, in the package's, writes expected_layers.npz.

    .venv/bin/python scripts/manylangs_fixture.py tests/fixtures/elmoformanylangs-tiny
"""

import json
import sys
from pathlib import Path

from model_export.manylangs import write_random_manylangs

ARCHITECTURE = {
    "encoder": {"name": "elmo", "projection_dim": 8, "cell_clip": 3, "proj_clip": 3, "dim": 16, "n_layers": 2},
    "token_embedder": {
        "name": "cnn",
        "activation": "relu",
        "filters": [[1, 4], [2, 8], [3, 8]],
        "n_highway": 2,
        "word_dim": 6,
        "char_dim": 4,
        "max_characters_per_token": 50,
    },
    "dropout": 0.1,  # read by the package, unused in inference
}
CHARS = [*"abcdefghijklmnopqrstuvwxyzTHEé.,'", "\u3000"]
WORDS = ["the", "cat", "sat", "on", "mat", "a", "café", ".", "The"]
# Unknown characters and words, a token over 48 characters, an empty one, the package's boundary spellings (and
# the published ones, ordinary tokens here), U+3000 alone and inside a token, lengths 1 to 45.
SENTENCES = [
    ["The", "cat", "sat", "on", "the", "mat", "."],
    ["Ünïcödé", "naïve", "café", "日本語", "🙂", "Zebra"],
    ["", "x" * 70, "<bos>", "<eos>", "<S>", "</S>", "a\u3000b", "\u3000"],
    ["a"],
    ("the cat sat on the mat because the mat was warm and the cat was cold " * 3).split(),
]


def main(folder: str) -> None:
    write_random_manylangs(folder, ARCHITECTURE, CHARS, WORDS, seed=0)
    text = json.dumps(SENTENCES, ensure_ascii=False, indent=1) + "\n"
    (Path(folder) / "sentences.json").write_text(text, encoding="utf-8")


if __name__ == "__main__":
    main(sys.argv[1])
