"""allennlp 0.9's own elmo command and ElmoEmbedder tests (elmo_test.py, vendored) against the adapter and a real
elmo-serve of the fixture model, found through $ELMO_URL as a migrated program finds it."""

from __future__ import annotations

import pytest

from tests.live_server import running_server

# What the service cannot do as allennlp 0.9 did, said once (docs/allennlp.md): strict, so that a change that makes
# one of them pass is noticed.
XFAIL = {
    "test_embeddings_are_as_expected": "stateful batches: allennlp's embedder carries the LSTM state from one batch "
    "to the next, and the expected embeddings were written so (batch after batch); the service is stateless, so "
    "its vectors equal the first batch's only",
    "test_embed_batch_is_empty_sentence": "an empty sentence is zeros of (num_layers, 0, dim) of the server's model, "
    "(3, 0, 32) here: allennlp 0.9 answers (3, 0, 1024) whatever the model",
}


def pytest_collection_modifyitems(items):
    for item in items:
        if item.fspath.basename == "elmo_test.py" and item.name in XFAIL:
            item.add_marker(pytest.mark.xfail(reason=XFAIL[item.name], strict=True))


@pytest.fixture(scope="module", autouse=True)
def elmo_url(tiny_model_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("allennlp09")
    with running_server(tiny_model_dir, folder) as server, pytest.MonkeyPatch.context() as mp:
        mp.setenv("ELMO_URL", server.url)
        yield server.url
