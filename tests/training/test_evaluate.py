"""training.evaluate: held-out perplexity of trained models over the vocabulary they share."""

from __future__ import annotations

import pytest

from training.language_model import TokenTable
from training.vocab import Vocabulary


def test_shared_vocabulary_perplexity_is_the_models_own_when_alone_and_compares_models(trained, corpus, tmp_path):
    from training.evaluate import load_language_model, shared_perplexity, shared_vocabulary
    from training.language_model import perplexity

    model, vocab = load_language_model(trained[0])
    sentences = [line.split() for line in corpus.read_text().splitlines()[:200]]
    alone = shared_perplexity(model, vocab, vocab.words, sentences)
    table = TokenTable(vocab, model.bilm.options.max_chars)
    own = perplexity(model, [table.encode(s) for s in sentences], table)
    assert alone["forward"] == pytest.approx(own.forward, abs=0.0051)  # rounded to 2 decimals
    assert alone["backward"] == pytest.approx(own.backward, abs=0.0051)
    # a second vocabulary without "cat" and "dog": they join <UNK>'s class, so the task is easier
    smaller = Vocabulary([w for w in vocab.words if w not in ("cat", "dog")])
    shared = shared_vocabulary([vocab, smaller])
    assert "cat" not in shared and len(shared) == len(vocab) - 2
    merged = shared_perplexity(model, vocab, shared, sentences)
    assert merged["forward"] < alone["forward"] and merged["predictions"] == alone["predictions"]


def test_evaluate_pools_the_files_and_takes_another_models_vocabulary(trained, corpus, tmp_path, capsys):
    """The `all` row is the files' predictions pooled (as one pass over all of them gives), and --vocabulary-of
    narrows the shared vocabulary as that model would without evaluating it."""
    from training.evaluate import load_language_model, main, pooled, shared_perplexity

    model, vocab = load_language_model(trained[0])
    lines = corpus.read_text().splitlines()[:120]
    files = [tmp_path / "a.txt", tmp_path / "b.txt"]
    files[0].write_text("\n".join(lines[:50]) + "\n")
    files[1].write_text("\n".join(lines[50:]) + "\n")
    other = tmp_path / "other"
    other.mkdir()
    Vocabulary([w for w in vocab.words if w not in ("cat", "dog")]).save(other / "vocab.txt")
    shared = [w for w in vocab.words if w not in ("cat", "dog")]
    parts = [shared_perplexity(model, vocab, shared, [x.split() for x in f.read_text().splitlines()]) for f in files]
    whole = shared_perplexity(model, vocab, shared, [x.split() for x in lines])
    together = pooled(parts)
    assert together["predictions"] == whole["predictions"]
    for d in ("forward", "backward"):
        assert together[d] == pytest.approx(whole[d], abs=0.0051)

    assert main(["--models", str(trained[0]), "--vocabulary-of", str(other), "--heldout", *map(str, files)]) == 0
    out = capsys.readouterr().out
    assert f"shared vocabulary: {len(shared):,} words" in out
    all_row = next(line for line in out.splitlines() if line.startswith("| all |"))
    assert all_row.split(" | ")[-2:] == [f"{together['forward']}", f"{together['backward']} |"]
