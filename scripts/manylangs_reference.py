"""The reference numbers of an ELMoForManyLangs model, from HIT-SCIR's own package (elmoformanylangs 0.0.4.post2).

Runs in an environment of its own, not the project's: the package needs `overrides<4` (newer versions refuse its
`@overrides` on methods without return types) and nothing of this project.

    python -m venv /tmp/efml && /tmp/efml/bin/pip install torch==2.13.0 h5py numpy "overrides<4"
    /tmp/efml/bin/pip install --no-deps elmoformanylangs==0.0.4.post2
    /tmp/efml/bin/python scripts/manylangs_reference.py MODEL_DIR SENTENCES.json OUT.npz

Writes each sentence's layers (L+1, tokens, 2P) as s0, s1, ... from a freshly loaded model, all sentences in one
batch: the package's LSTM is stateful, and its first batch after loading starts from the zero state, as every
sentence does in this project. `second_call_max_abs_diff` is how far the same sentences move when sent again.
"""

import json
import sys

import numpy as np
from elmoformanylangs import Embedder


def main(model_dir: str, sentences_path: str, out_path: str) -> None:
    with open(sentences_path, encoding="utf-8") as f:
        sentences = json.load(f)
    embedder = Embedder(model_dir, batch_size=len(sentences))  # one batch
    first = embedder.sents2elmo(sentences, output_layer=-2)  # every layer: (L+1, tokens, 2P)
    second = embedder.sents2elmo(sentences, output_layer=-2)  # the state the first batch left behind
    moved = max(float(np.abs(a - b).max()) for a, b in zip(first, second, strict=True))
    np.savez(out_path, second_call_max_abs_diff=np.float64(moved), **{f"s{i}": a for i, a in enumerate(first)})
    print(f"wrote {out_path}: {len(first)} sentences; the same sentences sent again differ by {moved:.3g}")


if __name__ == "__main__":
    main(*sys.argv[1:])
