"""elmo_client.allennlp.ElmoEmbedder, the stand-in for allennlp 0.9's, against a real elmo-serve on 127.0.0.1:
allennlp's methods with its documented shapes, and numbers equal to the service's and to allennlp's stateless
(first-batch) layers of the fixture."""

from __future__ import annotations

import gc
import inspect
import io
import json
import warnings

import h5py
import numpy as np
import pytest
from elmo_client import Client, ElmoError
from elmo_client.allennlp import DEFAULT_OPTIONS_FILE, DEFAULT_WEIGHT_FILE, ConfigurationError, ElmoEmbedder

from tests.allennlp_reference import run_allennlp
from tests.conftest import max_error
from tests.live_server import running_server

NUM_LAYERS, DIM = 3, 32
MAX_TOKENS = 60  # the server's max_tokens_per_sentence here: above every fixture sentence (53 at most)


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    settings = {"ELMO_MAX_TOKENS_PER_SENTENCE": str(MAX_TOKENS)}
    with running_server(tiny_model_dir, tmp_path_factory.mktemp("allennlp"), settings) as s:
        yield s


@pytest.fixture(scope="module")
def embedder(server):
    # allennlp's arguments as allennlp code passes them, positionally: accepted, and the server's model serves.
    elmo = ElmoEmbedder(DEFAULT_OPTIONS_FILE, DEFAULT_WEIGHT_FILE, -1, url=server.url)
    yield elmo
    elmo.close()


def test_embed_sentence_is_num_layers_by_tokens_by_dim(embedder, sentences, expected):
    got = [embedder.embed_sentence(s) for s in sentences[:5]]
    assert [g.shape for g in got] == [(NUM_LAYERS, len(s), DIM) for s in sentences[:5]]  # allennlp: (3, n, 1024)
    assert all(g.dtype == np.float32 for g in got)
    assert max_error(got, expected[:5]) <= 1e-5


def test_embed_batch_equals_the_service_and_allennlp_with_empty_sentences_as_zeros(
    embedder, server, sentences, expected
):
    batch = [sentences[0], [], *sentences[1:], []]
    got = embedder.embed_batch(batch)
    assert isinstance(got, list) and len(got) == len(batch)
    for k in (1, len(batch) - 1):  # allennlp's empty_embedding(): zeros of (3, 0, 1024), float64
        assert got[k].shape == (NUM_LAYERS, 0, DIM) and got[k].dtype == np.float64
    real = [got[0], *got[2:-1]]
    assert max_error(real, expected) <= 1e-5
    with Client(server.url) as client:
        service = client.embed(sentences, output="layers")
    for a, b in zip(real, service, strict=True):
        np.testing.assert_array_equal(a, b)
    assert [x.shape for x in embedder.embed_batch([[]])] == [(NUM_LAYERS, 0, DIM)]
    assert embedder.embed_batch([]) == []


def test_embed_sentences_is_a_generator_in_order(embedder, sentences, expected):
    stream = embedder.embed_sentences(iter(sentences), batch_size=7)
    assert inspect.isgenerator(stream)
    assert max_error(list(stream), expected) <= 1e-5
    assert "batch_size" in inspect.signature(ElmoEmbedder.embed_sentences).parameters


def read(path) -> dict:
    with h5py.File(path, "r") as f:
        return {key: f[key][()] for key in f}


@pytest.mark.parametrize(
    ("output_format", "layer"),
    [("all", lambda e: e), ("top", lambda e: e[-1]), ("average", lambda e: e.mean(axis=0))],
)
def test_embed_file_writes_allennlps_hdf5(embedder, sentences, expected, tmp_path, output_format, layer):
    text = "".join(" ".join(s) + "\n" for s in sentences)
    source = io.StringIO(text)
    embedder.embed_file(source, str(tmp_path / "out.hdf5"), output_format, batch_size=4)
    assert source.closed  # as allennlp does
    out = read(tmp_path / "out.hdf5")
    assert set(out) == {str(i) for i in range(len(sentences))} | {"sentence_to_index"}
    got = [out[str(i)] for i in range(len(sentences))]
    assert all(g.dtype == np.float32 for g in got)
    assert max_error(got, [layer(e.astype(np.float64)) for e in expected]) <= 1e-5
    index = json.loads(out["sentence_to_index"][0])
    assert index == {" ".join(s): str(i) for i, s in enumerate(sentences)}


def test_embed_file_keys(embedder, sentences, expected, tmp_path):
    lines = "".join(" ".join(s) + "\n" for s in sentences[:4])
    embedder.embed_file(io.StringIO(lines), str(tmp_path / "forget.hdf5"), forget_sentences=True)
    assert set(read(tmp_path / "forget.hdf5")) == {"0", "1", "2", "3"}
    embedder.embed_file(io.StringIO(lines), str(tmp_path / "keys.hdf5"), "top", use_sentence_keys=True)
    by_sentence = read(tmp_path / "keys.hdf5")
    assert set(by_sentence) == {" ".join(s) for s in sentences[:4]}  # and no sentence_to_index
    assert max_error([by_sentence[" ".join(s)] for s in sentences[:4]], [e[-1] for e in expected[:4]]) <= 1e-5
    with pytest.raises(ConfigurationError, match="Key already exists"):
        embedder.embed_file(io.StringIO(lines + lines), str(tmp_path / "twice.hdf5"), use_sentence_keys=True)


def test_embed_file_refuses_empty_lines(embedder, tmp_path):
    with pytest.raises(ConfigurationError, match=r"empty lines at indexes \[1, 3\]"):
        embedder.embed_file(io.StringIO("a b\n\nc\n  \n"), str(tmp_path / "x.hdf5"))


def test_the_url_comes_from_elmo_url(server, monkeypatch, sentences, expected):
    monkeypatch.setenv("ELMO_URL", server.url)
    elmo = ElmoEmbedder()
    try:
        assert elmo.client.url == server.url
        assert max_error([elmo.embed_sentence(sentences[3])], expected[3:4]) <= 1e-5
    finally:
        elmo.close()


def test_configuration_error_is_allennlps_where_allennlp_imports(tmp_path):
    done = run_allennlp("configuration_error.py", str(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.splitlines()[-1])
    assert result == {
        "subclass": True,
        "caught": "Your input file contains empty lines at indexes [1]. Please remove them.",
    }
    assert not issubclass(ConfigurationError, type(None)) and issubclass(
        ConfigurationError, Exception
    )  # here: no allennlp


def test_a_model_file_that_does_not_exist_is_refused_in_allennlps_words(tmp_path):
    for options, weights in ((str(tmp_path / "options.json"), None), (None, str(tmp_path / "weights.hdf5"))):
        with pytest.raises(FileNotFoundError, match=r"^file .* not found$"):
            ElmoEmbedder(options, weights, url="http://127.0.0.1:9")


def ours(warnings_seen) -> list:
    """The user warnings the embedder gave: pytest's own (a socket some earlier test left, collected meanwhile, is
    a PytestUnraisableExceptionWarning, a UserWarning too: a full run once saw one here) are not its."""
    return [
        w
        for w in warnings_seen
        if issubclass(w.category, UserWarning) and not issubclass(w.category, pytest.PytestWarning)
    ]


def test_files_and_device_given_are_warned_once_naming_the_servers_model(server, tiny_dir, sentences, recwarn):
    with ElmoEmbedder(str(tiny_dir / "options.json"), str(tiny_dir / "lm_weights.hdf5"), 0, url=server.url) as elmo:
        model = elmo.client.info()["model"]
        with pytest.warns(UserWarning) as warned:
            elmo.embed_sentence(sentences[0])
        (warning,) = ours(warned)
        message = str(warning.message)
        assert "options_file=" in message and "weight_file=" in message and "cuda_device=0" in message
        assert f"its model {model!r} ({NUM_LAYERS} layers of {DIM})" in message
        recwarn.clear()
        elmo.embed_batch(sentences[:2])
        assert not ours(recwarn)  # once
    with ElmoEmbedder(url=server.url) as plain:  # nothing given: nothing to warn about
        plain.embed_sentence(sentences[0])
    assert not ours(recwarn)


def test_the_embedder_is_a_context_manager_that_closes_its_connections(server, sentences):
    with warnings.catch_warnings():
        warnings.simplefilter("error", ResourceWarning)
        with ElmoEmbedder(url=server.url) as elmo:
            assert elmo.embed_sentence(sentences[0]).shape == (NUM_LAYERS, len(sentences[0]), DIM)
        assert elmo.client._http.is_closed
        del elmo
        gc.collect()


def test_a_sentence_over_the_servers_limit_is_refused_before_sending(server, sentences):
    with ElmoEmbedder(url=server.url) as elmo:
        sent = []
        elmo.client._http.event_hooks["request"].append(lambda request: sent.append(request.url.path))
        long = ["word"] * (MAX_TOKENS + 1)
        with pytest.raises(ElmoError, match=r"of 61 tokens .* max_tokens_per_sentence, 60: split it") as refused:
            elmo.embed_batch([sentences[0], long])
        assert refused.value.status == 413 and "/embed" not in sent
        assert elmo.embed_sentence(["word"] * MAX_TOKENS).shape == (NUM_LAYERS, MAX_TOKENS, DIM)  # at the limit
