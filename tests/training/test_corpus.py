"""The corpus builder (training.corpus): the prose filter, and the multi-source build (dedup across sources, a
fixed held-out split per source, the manifest). Made-up sources stand in for the Debian packages, which a fresh
clone need not have."""

from __future__ import annotations

import hashlib
import json

from training.corpus import build_sources, looks_like_prose, source_heldout
from training.texts import (
    Source,
    Unit,
)


def test_prose_filter():
    assert looks_like_prose(str.split("The driver reads the value , then writes it ."))
    assert not looks_like_prose(str.split("foo_bar ( x , y ) ; /sys/kernel/foo = 0x1f"))


def _fake_sources() -> dict[str, Source]:
    def alpha():
        for k in range(200):
            yield Unit(f"a{k}", (f"Alpha sentence number {k} is here. It has a second part {k}.",))
        yield Unit("dup", ("The very same sentence appears twice.",))

    def beta():
        yield Unit("b0", ("The very same sentence appears twice.", "Too short"), split_sentences=False)
        yield Unit("b1", ("x = foo_bar ( y ) ; /dev/null 0x1f", "This one is ordinary prose text."))

    return {
        "alpha": Source("alpha", ("pkg-a",), "public domain", "/nowhere", alpha),
        "beta": Source("beta", ("pkg-b",), "GPL-2", "/nowhere", beta, prose_filter=True),
    }


def test_build_sources_dedups_splits_per_source_and_writes_a_manifest(tmp_path):
    manifest = build_sources(tmp_path, ["alpha", "beta"], _fake_sources())
    alpha, beta = manifest["sources"]["alpha"], manifest["sources"]["beta"]
    assert alpha["units"] == 201 and alpha["license"] == "public domain"
    held = [k for k in range(200) if source_heldout("alpha", f"a{k}")]
    assert 0 < len(held) < 20  # about 1 in 50
    assert alpha["heldout"]["sentences"] == 2 * len(held)
    assert alpha["train"]["sentences"] == 2 * (200 - len(held)) + 1
    heldout_text = (tmp_path / "heldout" / "alpha.txt").read_text()
    assert f"Alpha sentence number {held[0]} is here ." in heldout_text  # tokenized like the service
    # beta: its first sentence was already in alpha, "Too short" has 2 tokens, the code line is not prose
    assert (beta["duplicate"], beta["too_short"], beta["not_prose"]) == (1, 1, 1)
    assert (tmp_path / "train" / "beta.txt").read_text() + (tmp_path / "heldout" / "beta.txt").read_text() == (
        "This one is ordinary prose text .\n"
    )
    for split in ("train", "heldout"):
        path = tmp_path / split / "alpha.txt"
        assert alpha[split]["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
        assert alpha[split]["tokens"] == sum(len(line.split()) for line in path.read_text().splitlines())
    assert manifest["total"]["train"]["tokens"] == alpha["train"]["tokens"] + beta["train"]["tokens"]
    assert json.loads((tmp_path / "manifest.json").read_text()) == manifest
    again = build_sources(tmp_path / "again", ["alpha", "beta"], _fake_sources())
    assert again["sources"]["alpha"]["train"]["sha256"] == alpha["train"]["sha256"]  # reproducible


def test_wordnet_keeps_the_held_out_synsets_of_the_wordnet_only_corpus():
    import zlib

    for key in ("n02787772", "v00001740", "a00001740"):
        assert source_heldout("wordnet", key) == (zlib.crc32(key.encode()) % 50 == 0)
