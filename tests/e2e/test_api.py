"""The HTTP API end to end: a real elmo-serve (uvicorn) process on 127.0.0.1, spoken to over HTTP. Vectors are
checked against allennlp's layers and plain numpy formulas; errors by status and the field named in `detail`."""

from __future__ import annotations

import asyncio
import base64
import io
import itertools
import json
import math
import re

import httpx
import numpy as np
import pytest

from service.engine.providers import cpu_flags
from service.settings import default_window
from tests.conftest import max_error
from tests.live_server import Server, answered_statuses, counter, refusal, running_server, status_on

MAX_SENTENCES, MAX_TOKENS, MAX_BODY = 64, 400, 200_000
SETTINGS = {
    "ELMO_MAX_SENTENCES": str(MAX_SENTENCES),
    "ELMO_MAX_TOKENS_PER_SENTENCE": str(MAX_TOKENS),
    "ELMO_MAX_BODY_BYTES": str(MAX_BODY),
}
NUM_LAYERS, DIM = 3, 32
HELLO = ["Hello", ",", "world", "!"]
# A sentence's vectors in another batch (alone, or with other sentences of other lengths): the bar is 1e-6. On CPU
# they are the same bits (the graph never runs a 1-row GEMM, whose rounding differs). Distinct sentences differ by
# >= 0.2.
BATCH_TOLERANCE = 1e-6


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory) -> Server:
    with running_server(tiny_model_dir, tmp_path_factory.mktemp("serve"), SETTINGS) as s:
        yield s


# -- helpers --------------------------------------------------------------------------------------------------------


def embed(client: httpx.Client, sentences: list, **options) -> dict:
    response = client.post("/embed", json={"sentences": sentences, **options})
    assert response.status_code == 200, response.text
    return response.json()


def array(item: dict) -> np.ndarray:
    """An answer's embedding as float32 of its `shape`, from nested lists or base64."""
    shape, embedding = tuple(item["shape"]), item["embedding"]
    if isinstance(embedding, str):
        flat = np.frombuffer(base64.b64decode(embedding, validate=True), dtype="<f4")
        assert flat.size == math.prod(shape)
        return flat.reshape(shape)
    out = np.asarray(embedding, dtype=np.float32)
    assert out.shape == shape
    return out


def arrays(body: dict) -> list[np.ndarray]:
    assert [item["index"] for item in body["data"]] == list(range(len(body["data"])))
    return [array(item) for item in body["data"]]


def reference_mix(layers, weights=None, gamma=1.0, normalize="softmax", layer_norm=False) -> np.ndarray:
    """gamma * sum_j w_j h_j in float64 from allennlp's layers (L, n, D); w = softmax(weights) or as given;
    layer_norm: each h_j scaled to mean 0, variance 1 over the sentence's tokens and dims (epsilon 1e-12)."""
    h = layers.astype(np.float64)
    if layer_norm:
        h = (h - h.mean(axis=(1, 2), keepdims=True)) / np.sqrt(h.var(axis=(1, 2), keepdims=True) + 1e-12)
    w = np.zeros(len(h)) if weights is None else np.asarray(weights, dtype=np.float64)
    if normalize == "softmax":
        w = np.exp(w) / np.exp(w).sum()
    return gamma * np.einsum("l,ltd->td", w, h)


def mix_tolerance(layers, weights=None, gamma=1.0, normalize="softmax", layer_norm=False) -> float:
    """The served layers are within 1e-5 of allennlp's; a mix is linear in them, so its error is within
    1e-5 * |gamma| * sum_j |w_j| / sigma_j (sigma_j: layer j's spread when layer-normed, else 1)."""
    w = np.zeros(len(layers)) if weights is None else np.asarray(weights, dtype=np.float64)
    if normalize == "softmax":
        w = np.exp(w) / np.exp(w).sum()
    sigma = layers.astype(np.float64).std(axis=(1, 2)) if layer_norm else np.ones(len(layers))
    return 1e-5 * abs(gamma) * float(np.sum(np.abs(w) / sigma))


def assert_mix(got: np.ndarray, layers: np.ndarray, pooled: bool = False, **mix) -> None:
    want = reference_mix(layers, **mix)
    want = want.mean(axis=0) if pooled else want
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=mix_tolerance(layers, **mix))


def long_sentence(sentences, n: int, start: int = 0) -> list[str]:
    return list(itertools.islice(itertools.cycle(itertools.chain(*sentences)), start, start + n))


# -- numbers --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("encoding", ["float", "base64"])
def test_layers_equal_allennlp(client, tiny_model_dir, sentences, expected, encoding):
    body = embed(client, sentences, output="layers", encoding=encoding)
    assert (body["model"], body["dim"], body["num_layers"]) == (tiny_model_dir.name, DIM, NUM_LAYERS)
    assert body["usage"] == {"sentences": len(sentences), "tokens": sum(map(len, sentences))}
    assert [item["tokens"] for item in body["data"]] == sentences
    assert [item["shape"] for item in body["data"]] == [[NUM_LAYERS, len(s), DIM] for s in sentences]
    assert max_error(arrays(body), expected) <= 1e-5


def test_base64_is_little_endian_float32_in_c_order(client, sentences):
    as_float = arrays(embed(client, sentences[:4], output="layers"))
    as_base64 = arrays(embed(client, sentences[:4], output="layers", encoding="base64"))
    for f, b in zip(as_float, as_base64, strict=True):
        assert b.dtype == np.dtype("<f4") and b.shape == f.shape
        np.testing.assert_array_equal(b, f)  # a float32 survives JSON exactly: any byte or order slip shows


def npz_answer(client: httpx.Client, sentences: list, accept: str = "application/x-npz", **options):
    response = client.post("/embed", json={"sentences": sentences, **options}, headers={"accept": accept})
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "application/x-npz"
    return np.load(io.BytesIO(response.content), allow_pickle=False)  # numpy reads the body alone


@pytest.mark.parametrize(
    "options",
    [{"output": "layers"}, {}, {"pooling": "mean"}, {"mixes": [{"weights": [1.0, 0.0, 0.0]}, {}]}],
    ids=["layers", "mix", "pooled", "mixes"],
)
def test_npz_answer_holds_the_very_numbers_of_json(client, sentences, options):
    npz = npz_answer(client, sentences[:5], **options)
    answer = json.loads(npz["answer.json"])
    as_json = embed(client, sentences[:5], encoding="base64", **options)
    assert {k: v for k, v in answer.items() if k != "data"} == {k: v for k, v in as_json.items() if k != "data"}
    assert sorted(npz.files) == sorted(["answer.json", *(f"embedding_{i}" for i in range(5))])
    for item, json_item, want in zip(answer["data"], as_json["data"], arrays(as_json), strict=True):
        assert item == {k: v for k, v in json_item.items() if k != "embedding"}  # index, tokens, shape
        got = npz[f"embedding_{item['index']}"]
        assert got.dtype == np.dtype("<f4") and list(got.shape) == item["shape"]
        np.testing.assert_array_equal(got, want)


def test_float16_halves_the_bytes_of_base64_and_npz_and_rounds_each_number_once(client, sentences):
    want = arrays(embed(client, sentences[:4], output="layers", encoding="base64"))
    half = embed(client, sentences[:4], output="layers", encoding="base64", dtype="float16")
    full = embed(client, sentences[:4], output="layers", encoding="base64")
    for item, item32, w in zip(half["data"], full["data"], want, strict=True):
        assert item["dtype"] == "float16" and "dtype" not in item32
        got = np.frombuffer(base64.b64decode(item["embedding"]), "<f2").reshape(item["shape"])
        np.testing.assert_array_equal(got, w.astype(np.float16))  # the float32 answer rounded once
        assert len(base64.b64decode(item["embedding"])) * 2 == len(base64.b64decode(item32["embedding"]))
    npz = npz_answer(client, sentences[:4], output="layers", dtype="float16")
    for i, w in enumerate(want):
        assert npz[f"embedding_{i}"].dtype == np.dtype("<f2")
        np.testing.assert_array_equal(npz[f"embedding_{i}"], w.astype(np.float16))
    # JSON numbers have no width to halve: refused, naming the field
    response = client.post("/embed", json={"sentences": sentences[:1], "dtype": "float16"})
    assert response.status_code == 422 and "dtype" in response.text
    response = client.post("/embed", json={"sentences": sentences[:1], "dtype": "float64", "encoding": "base64"})
    assert response.status_code == 422 and "dtype" in response.text


def test_npz_answer_when_asked_for_only(client, sentences):
    for accept in ("application/json", "*/*", "application/x-npz;q=0", "application/json, application/x-npz;q=0.5"):
        response = client.post("/embed", json={"sentences": sentences[:1]}, headers={"accept": accept})
        assert response.headers["content-type"] == "application/json", accept
    npz_answer(client, sentences[:1], accept="application/json;q=0.9, application/x-npz")
    for accept in ("application/json", "application/x-npz"):  # one URL, two answers: caches must key on Accept
        response = client.post("/embed", json={"sentences": sentences[:1]}, headers={"accept": accept})
        assert response.headers["vary"] == "accept"
    info = client.get("/info").json()
    assert info["answer_media_types"] == {"/embed": ["application/json", "application/x-npz"]}


def test_a_large_npz_answer_is_encoded_off_the_loop_and_whole(client):
    long = [[f"w{k % 50}" for k in range(MAX_TOKENS)] for _ in range(4)]  # 3 x 1600 vectors of 32: 0.6 MB
    many = [[f"x{k % 30}" for k in range(MAX_TOKENS)] for _ in range(8)]  # 1.2 MB: over OFF_LOOP_BYTES
    for sentences in (long, many):
        npz = npz_answer(client, sentences, output="layers")
        want = arrays(embed(client, sentences, output="layers", encoding="base64"))
        for i, w in enumerate(want):
            np.testing.assert_array_equal(npz[f"embedding_{i}"], w)


def test_layer_selection_picks_and_orders(client, sentences, expected):
    for ids in ([2, 0], [-1], [1, 1, 0]):
        got = arrays(embed(client, sentences, output="layers", layers=ids))
        assert max_error(got, [e[ids] for e in expected]) <= 1e-5


MIXES = [
    pytest.param({}, id="default-equal-weights"),
    pytest.param({"weights": [0.5, -1.0, 2.0], "gamma": 0.7}, id="softmax"),
    pytest.param({"weights": [0.2, 0.3, 0.5], "gamma": 2.0, "normalize": "none"}, id="none"),
    pytest.param({"weights": [1.0, -0.5, 0.25], "gamma": -1.5, "normalize": "none"}, id="none-negative"),
    pytest.param({"weights": [0.1, 0.2, 0.3], "layer_norm": True}, id="layer-norm-softmax"),
    pytest.param({"weights": [1.0, 0.5, -2.0], "gamma": 3.0, "normalize": "none", "layer_norm": True}, id="ln-none"),
]


@pytest.mark.parametrize("mix", MIXES)
def test_mix_equals_numpy_formula(client, sentences, expected, mix):
    body = embed(client, sentences, **mix)
    assert [item["shape"] for item in body["data"]] == [[len(s), DIM] for s in sentences]
    for got, layers in zip(arrays(body), expected, strict=True):
        assert_mix(got, layers, **mix)


def test_mean_pooling(client, sentences, expected):
    mix = {"weights": [0.3, -0.2, 1.1], "gamma": 1.25}
    body = embed(client, sentences, pooling="mean", **mix)
    assert all(item["shape"] == [DIM] for item in body["data"])
    for got, layers in zip(arrays(body), expected, strict=True):
        assert_mix(got, layers, pooled=True, **mix)
    body = embed(client, sentences, output="layers", layers=[2, 0], pooling="mean")
    assert max_error(arrays(body), [e[[2, 0]].mean(axis=1) for e in expected]) <= 1e-5


def test_several_mixes_get_a_leading_axis(client, sentences, expected):
    mixes = [
        {"weights": [1.0, 2.0, 3.0], "gamma": 0.5},
        {"weights": [0.0, 1.0, 0.0], "normalize": "none", "layer_norm": True},
    ]
    none = embed(client, sentences, mixes=mixes)
    mean = embed(client, sentences, mixes=mixes, pooling="mean")
    one = embed(client, sentences, mixes=mixes[:1])
    for s, layers, a, b, c in zip(sentences, expected, arrays(none), arrays(mean), arrays(one), strict=True):
        assert a.shape == (2, len(s), DIM) and b.shape == (2, DIM) and c.shape == (1, len(s), DIM)
        for k, mix in enumerate(mixes):
            assert_mix(a[k], layers, **mix)
            assert_mix(b[k], layers, pooled=True, **mix)
        assert_mix(c[0], layers, **mixes[0])


def test_boundaries_add_the_bilms_vectors_of_the_sentence_boundaries(client, sentences, expected):
    # allennlp's keep_sentence_boundaries: <S> first and </S> last, as the biLM computed them; the tokens between
    # are the answer without boundaries; layer_norm and pooling count the two positions
    batch = [*sentences[:4], [], "The bank."]
    body = embed(client, batch, output="layers", boundaries=True)
    assert [item["tokens"] for item in body["data"]] == [["<S>", *s, "</S>"] for s in sentences[:4]] + [
        ["<S>", "</S>"],
        ["<S>", "The", "bank", ".", "</S>"],
    ]
    got = arrays(body)
    assert [g.shape for g in got] == [(NUM_LAYERS, len(s) + 2, DIM) for s in sentences[:4]] + [
        (NUM_LAYERS, 2, DIM),
        (NUM_LAYERS, 5, DIM),
    ]
    assert max_error([g[:, 1:-1] for g in got[:4]], expected[:4]) <= 1e-5
    plain = arrays(embed(client, batch[:4], output="layers"))
    assert all(np.array_equal(g[:, 1:-1], p) for g, p in zip(got[:4], plain, strict=True))
    assert min(float(np.abs(g[1:, [0, -1]]).max()) for g in got) > 0.01  # computed, not zeros
    mix = {"weights": [0.3, -0.2, 1.1], "gamma": 1.25, "layer_norm": True}
    for g, m in zip(got, arrays(embed(client, batch, boundaries=True, **mix)), strict=True):
        assert_mix(m, g, **mix)  # the statistics over the boundaries too
    pooled = arrays(embed(client, batch[:1], boundaries=True, output="layers", pooling="mean"))[0]
    np.testing.assert_allclose(pooled, got[0].mean(axis=1), rtol=0, atol=1e-6)
    assert client.post("/embed", json={"sentences": [["a"], []]}).status_code == 422  # without: still refused


def test_strings_are_tokenized_like_the_same_tokens(client):
    river = ["The", "bank", "of", "the", "river", "."]
    texts = ["Hello, world!", "  Hello,   world!\n", "The bank of the river."]
    body = embed(client, [*texts, HELLO], output="layers")
    assert [item["tokens"] for item in body["data"]] == [HELLO, HELLO, river, HELLO]
    assert body["usage"] == {"sentences": 4, "tokens": 4 + 4 + 6 + 4}
    got = arrays(body)
    tokens = arrays(embed(client, [river, HELLO], output="layers"))
    assert max_error(got, [tokens[1], tokens[1], tokens[0], tokens[1]]) <= BATCH_TOLERANCE


# -- unit-length vectors, truncation, /tokenize -----------------------------------------------------------------------


def unit(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


UNIT_CASES = [
    pytest.param({}, id="mix"),
    pytest.param({"weights": [0.5, -1.0, 2.0], "gamma": 0.7, "normalize": "none"}, id="mix-normalize-none"),
    pytest.param({"pooling": "mean", "layer_norm": True}, id="mix-mean"),
    pytest.param({"output": "layers"}, id="layers"),
    pytest.param({"output": "layers", "layers": [2, 0], "pooling": "mean", "encoding": "base64"}, id="layers-mean"),
    pytest.param({"mixes": [{"weights": [1.0, 2.0, 3.0]}, {"gamma": 3.0}]}, id="mixes"),
]


@pytest.mark.parametrize("options", UNIT_CASES)
def test_unit_length_scales_every_vector_of_the_answer_last(client, sentences, options):
    plain = arrays(embed(client, sentences[:6], **options))
    scaled = arrays(embed(client, sentences[:6], unit_length=True, **options))
    for p, u in zip(plain, scaled, strict=True):
        assert u.shape == p.shape and u.dtype == np.float32
        # Each layer's, mix's or pooled vector on its own (the same batch: the same bits before scaling).
        np.testing.assert_allclose(u, unit(p), rtol=0, atol=1e-7)
        np.testing.assert_allclose(np.linalg.norm(u.astype(np.float64), axis=-1), 1.0, atol=1e-6)


def test_unit_length_on_openai_embeddings(client):
    texts = ["Hello, world!", "The bank of the river."]
    plain, scaled = (
        client.post("/v1/embeddings", json={"input": texts, "unit_length": flag}).json()["data"]
        for flag in (False, True)
    )
    for p, u in zip(plain, scaled, strict=True):
        np.testing.assert_allclose(u["embedding"], unit(np.asarray(p["embedding"], np.float32)), rtol=0, atol=1e-7)


def test_truncate_cuts_a_sentence_to_the_limit_and_says_so(client, sentences):
    long = long_sentence(sentences, MAX_TOKENS + 50)
    text = " ".join(["word"] * (MAX_TOKENS + 10)) + ", the end."  # Moses: MAX_TOKENS + 14 tokens
    body = embed(client, [long, sentences[0], text], output="layers", encoding="base64", truncate=True)
    items = body["data"]
    assert [(i["truncated"], i["original_tokens"]) for i in items] == [
        (True, MAX_TOKENS + 50),
        (False, len(sentences[0])),
        (True, MAX_TOKENS + 14),
    ]
    assert items[0]["tokens"] == long[:MAX_TOKENS] and items[2]["tokens"] == ["word"] * MAX_TOKENS
    assert [i["shape"] for i in items] == [[NUM_LAYERS, n, DIM] for n in (MAX_TOKENS, len(sentences[0]), MAX_TOKENS)]
    assert body["usage"]["tokens"] == 2 * MAX_TOKENS + len(sentences[0])
    # A cut sentence's vectors are those of its first MAX_TOKENS tokens sent as they are.
    got, alone = arrays(body), layers_of(client, [long[:MAX_TOKENS], ["word"] * MAX_TOKENS])
    assert max_error([got[0], got[2]], alone) <= BATCH_TOLERANCE
    # Not asked for: no such fields, and the same request is refused as before.
    assert "truncated" not in embed(client, [sentences[0]])["data"][0]
    assert_refused(client.post("/embed", json={"sentences": [long]}), 413, "sentences[0]")


def test_truncate_on_openai_embeddings(client):
    cut = " ".join(["word"] * MAX_TOKENS)
    response = client.post("/v1/embeddings", json={"input": [cut + " and more", "short"], "truncate": True})
    assert response.status_code == 200, response.text
    data = response.json()["data"]
    assert [(d["truncated"], d["original_tokens"]) for d in data] == [(True, MAX_TOKENS + 2), (False, 1)]
    assert response.json()["usage"]["prompt_tokens"] == MAX_TOKENS + 1
    same = client.post("/v1/embeddings", json={"input": cut}).json()["data"][0]
    assert "truncated" not in same
    np.testing.assert_allclose(data[0]["embedding"], same["embedding"], rtol=0, atol=BATCH_TOLERANCE)


def test_tokenize_shows_the_tokens_and_the_bytes_the_model_reads(client):
    wide = "é" * 30  # 60 UTF-8 bytes: the char mapping keeps the first 48 (24 characters)
    response = client.post("/tokenize", json={"sentences": ["Hello, world!", ["a", wide, "🙂"]]})
    assert response.status_code == 200, response.text
    body = response.json()
    assert (body["max_tokens_per_sentence"], body["max_bytes_per_token"]) == (MAX_TOKENS, 48)
    assert body["token_cut"] == "the first 48 UTF-8 bytes"
    assert body["usage"] == {"sentences": 2, "tokens": 7}
    assert body["data"] == [
        {"index": 0, "tokens": HELLO, "utf8_bytes": [5, 1, 5, 1], "kept_bytes": [5, 1, 5, 1], "truncated": False,
         "original_tokens": 4},
        {"index": 1, "tokens": ["a", wide, "🙂"], "utf8_bytes": [1, 60, 4], "kept_bytes": [1, 48, 4],
         "truncated": False, "original_tokens": 3},
    ]  # fmt: skip
    assert embed(client, ["Hello, world!"])["data"][0]["tokens"] == HELLO  # what /embed reads, too
    # What is not kept makes no difference: tokens that agree in their first 48 bytes get the same vectors.
    same = arrays(embed(client, [["x", wide], ["x", "é" * 24 + "different"]], output="layers"))
    np.testing.assert_array_equal(same[0], same[1])


def test_tokenize_truncates_like_embed(client, sentences):
    long = long_sentence(sentences, MAX_TOKENS + 3)
    assert_refused(client.post("/tokenize", json={"sentences": [["a"], long]}), 413, "sentences[1]")
    response = client.post("/tokenize", json={"sentences": [["a"], long], "truncate": True})
    assert response.status_code == 200, response.text
    cut = response.json()["data"][1]
    assert (cut["tokens"], cut["truncated"], cut["original_tokens"]) == (long[:MAX_TOKENS], True, MAX_TOKENS + 3)
    assert len(cut["utf8_bytes"]) == len(cut["kept_bytes"]) == MAX_TOKENS


# -- concurrency and batching ---------------------------------------------------------------------------------------


async def _post_all(url: str, bodies: list[dict]) -> list[httpx.Response]:
    limits = httpx.Limits(max_connections=len(bodies))
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as ac:
        return await asyncio.gather(*(ac.post("/embed", json=body) for body in bodies))


def layers_of(client: httpx.Client, sentences: list) -> list[np.ndarray]:
    return arrays(embed(client, sentences, output="layers", encoding="base64"))


def test_100_concurrent_clients_each_get_their_own_vectors(server, client, sentences):
    # Every client a sentence of its own (a unique last token, lengths 1..54); odd clients send a second one.
    own = [[*sentences[k % 30][k // 30 :], f"client-{k}"] for k in range(100)]
    requests = [[s, s[::-1]] if k % 2 else [s] for k, s in enumerate(own)]
    responses = asyncio.run(
        _post_all(server.url, [{"sentences": r, "output": "layers", "encoding": "base64"} for r in requests])
    )
    for sent, response in zip(requests, responses, strict=True):
        assert response.status_code == 200, response.text
        body = response.json()
        assert [item["tokens"] for item in body["data"]] == sent
        assert max_error(arrays(body), [layers_of(client, [s])[0] for s in sent]) <= BATCH_TOLERANCE


def test_vectors_do_not_depend_on_the_batch(client, sentences):
    target, long = sentences[5], long_sentence(sentences, 300)
    request = [long, sentences[0], target, sentences[3]]  # the target padded to 302 steps
    mixed, pair = layers_of(client, request), layers_of(client, [sentences[7], target])
    alone, long_alone = layers_of(client, [target])[0], layers_of(client, [long])[0]
    assert max_error([mixed[2], pair[1], mixed[0]], [alone, alone, long_alone]) <= BATCH_TOLERANCE
    np.testing.assert_array_equal(layers_of(client, [target])[0], alone)  # the same call again: the same bits
    for again, first in zip(layers_of(client, request), mixed, strict=True):
        np.testing.assert_array_equal(again, first)


def test_a_request_spread_over_several_batches(client, sentences):
    # 14 sentences of 300 tokens are 4228 padded tokens: more than one engine batch of 4096.
    batch = [long_sentence(sentences, 300, start=7 * k) for k in range(14)] + [sentences[3]]
    together = layers_of(client, batch)
    assert max_error(together, [layers_of(client, [s])[0] for s in batch]) <= BATCH_TOLERANCE


# -- errors ---------------------------------------------------------------------------------------------------------

ONE = [["a"]]
BAD_BODIES = [  # (id, body, the field `detail` starts with)
    ("weights-length", {"sentences": ONE, "weights": [1.0, 2.0]}, "weights"),
    ("mix-weights-length", {"sentences": ONE, "mixes": [{"weights": [0.0] * 3}, {"weights": [1.0]}]}, "mixes[1]"),
    ("no-sentences", {"sentences": []}, "sentences"),
    ("missing-sentences", {"weights": [0.0] * 3}, "sentences"),
    ("empty-token-list", {"sentences": [["a"], []]}, "sentences[1]"),
    ("whitespace-string", {"sentences": ["fine", " \t\n "]}, "sentences[1]"),
    ("empty-string", {"sentences": [""]}, "sentences[0]"),
    ("unknown-output", {"sentences": ONE, "output": "all"}, "output"),
    ("no-layers", {"sentences": ONE, "output": "layers", "layers": []}, "layers"),
    ("unknown-normalize", {"sentences": ONE, "normalize": "l2"}, "normalize"),
    ("unknown-pooling", {"sentences": ONE, "pooling": "max"}, "pooling"),
    ("unknown-encoding", {"sentences": ONE, "encoding": "hex"}, "encoding"),
    ("string-boundaries", {"sentences": ONE, "boundaries": "yes"}, "boundaries"),
    ("mix-unknown-normalize", {"sentences": ONE, "mixes": [{"normalize": "l1"}]}, "mixes"),
    ("layer-too-high", {"sentences": ONE, "output": "layers", "layers": [0, 3]}, "layers[1]"),
    ("layer-too-low", {"sentences": ONE, "output": "layers", "layers": [-4]}, "layers[0]"),
    ("layers-with-mix", {"sentences": ONE, "layers": [0]}, "layers"),
    ("gamma-with-layers", {"sentences": ONE, "output": "layers", "gamma": 2.0}, "gamma"),
    ("mixes-and-weights", {"sentences": ONE, "mixes": [{}], "weights": [0.0] * 3}, "mixes"),
    ("no-mixes", {"sentences": ONE, "mixes": []}, "mixes"),
    ("number-token", {"sentences": [["a", 1]]}, "sentences"),
    ("number-sentence", {"sentences": [5]}, "sentences"),
    ("string-sentences", {"sentences": "a b"}, "sentences"),
    ("string-gamma", {"sentences": ONE, "gamma": "1"}, "gamma"),
    ("bool-gamma", {"sentences": ONE, "gamma": True}, "gamma"),
    ("string-weights", {"sentences": ONE, "weights": ["1", "2", "3"]}, "weights"),
    ("int-layer-norm", {"sentences": ONE, "layer_norm": 1}, "layer_norm"),
    ("float-layer", {"sentences": ONE, "output": "layers", "layers": [1.0]}, "layers"),
    ("weight-over-bound", {"sentences": ONE, "weights": [1e7, 0.0, 0.0]}, "weights"),
    ("unknown-field", {"sentences": ONE, "weight": [0.0] * 3}, "weight"),
    ("unknown-mix-field", {"sentences": ONE, "mixes": [{"scale": 2.0}]}, "mixes"),
    ("int-unit-length", {"sentences": ONE, "unit_length": 1}, "unit_length"),
    ("string-truncate", {"sentences": ONE, "truncate": "yes"}, "truncate"),
]
BAD_TEXTS = [  # (id, raw body, the field): what a JSON encoder would refuse to write
    ("nan-gamma", b'{"sentences": [["a"]], "gamma": NaN}', "gamma"),
    ("infinity-weight", b'{"sentences": [["a"]], "weights": [0, Infinity, 0]}', "weights"),
    ("minus-infinity-gamma", b'{"sentences": [["a"]], "gamma": -Infinity}', "gamma"),
    ("overflowing-weight", b'{"sentences": [["a"]], "weights": [0, 1e400, 0]}', "weights"),
    ("nan-in-mixes", b'{"sentences": [["a"]], "mixes": [{"weights": [NaN, 0, 0]}]}', "mixes"),
    ("truncated", b'{"sentences": [["a"]]', "body"),
    ("trailing-garbage", b'{"sentences": [["a"]]} x', "body"),
    ("not-json", b"sentences=a", "body"),
    ("not-an-object", b'[["a"]]', "body"),
    ("null", b"null", "body"),
    ("empty", b"", "body"),
    ("not-utf8", b'{"sentences": [["\xff\xfe"]]}', "body"),
    ("nested-too-deep", b'{"sentences": ' + b"[" * 20_000 + b"]" * 20_000 + b"}", "body"),
    ("lone-surrogate-token", b'{"sentences": [["ok"], ["a", "\\ud800"]]}', "sentences[1]"),
    ("lone-surrogate-string", b'{"sentences": ["abc \\udfff"]}', "sentences[0]"),
]
BAD_OPENAI = [
    ("empty-list", {"input": []}, "input"),
    ("empty-string", {"input": ""}, "input[0]"),
    ("blank-item", {"input": ["fine", "   "]}, "input[1]"),
    ("missing-input", {"model": "elmo"}, "input"),
    ("number-input", {"input": 5}, "input"),
    ("token-ids", {"input": [1, 2]}, "input"),
    ("token-id-lists", {"input": [[1, 2], [3]]}, "input"),
    ("unknown-format", {"input": "a", "encoding_format": "int8"}, "encoding_format"),
    ("string-truncate", {"input": "a", "truncate": "yes"}, "truncate"),
    ("number-model", {"input": "a", "model": 1}, "model"),
    ("dimensions-not-the-model-s", {"input": "a", "dimensions": DIM // 2}, "dimensions"),
    ("dimensions-string", {"input": "a", "dimensions": "32"}, "dimensions"),
]


def assert_refused(response: httpx.Response, status: int, field: str) -> str:
    """Refused with `status` (OpenAI's under /v1/), and a message that starts with the field."""
    assert response.status_code == status_on(response.request.url.path, status), response.text
    assert response.headers["content-type"].startswith("application/json")
    detail = refusal(response)
    assert isinstance(detail, str) and detail.startswith(field), detail
    return detail


@pytest.mark.parametrize(("body", "field"), [c[1:] for c in BAD_BODIES], ids=[c[0] for c in BAD_BODIES])
def test_invalid_embed_body_is_422_naming_the_field(client, body, field):
    assert_refused(client.post("/embed", json=body), 422, field)


@pytest.mark.parametrize(("text", "field"), [c[1:] for c in BAD_TEXTS], ids=[c[0] for c in BAD_TEXTS])
def test_invalid_json_text_is_422_naming_the_field(client, text, field):
    response = client.post("/embed", content=text, headers={"content-type": "application/json"})
    assert_refused(response, 422, field)


@pytest.mark.parametrize("route", ["/embed", "/v1/embeddings"])
@pytest.mark.parametrize("kind", ["text/plain", "application/x-www-form-urlencoded"])  # the second: curl -d's
def test_body_that_is_not_declared_json_is_422_naming_the_header(client, route, kind):
    body = b'{"sentences": [["a"]], "input": "a"}'
    detail = assert_refused(client.post(route, content=body, headers={"content-type": kind}), 422, "body")
    assert detail == (
        f"body: sent as {kind}, not JSON: send the header Content-Type: application/json "
        "(curl: -H 'content-type: application/json')"
    )


@pytest.mark.parametrize(("body", "field"), [c[1:] for c in BAD_OPENAI], ids=[c[0] for c in BAD_OPENAI])
def test_invalid_openai_body_is_400_naming_the_field(client, body, field):
    response = client.post("/v1/embeddings", json=body)
    assert_refused(response, 422, field)  # 400, as OpenAI answers
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] is None
    assert error["param"] == (None if field == "body" else field)


BAD_TOKENIZE = [
    ("no-sentences", {"sentences": []}, "sentences"),
    ("empty-string", {"sentences": ["a", " "]}, "sentences[1]"),
    ("empty-token-list", {"sentences": [[]]}, "sentences[0]"),
    ("mix-field", {"sentences": ONE, "weights": [0.0] * 3}, "weights"),
    ("string-truncate", {"sentences": ONE, "truncate": "no"}, "truncate"),
]


@pytest.mark.parametrize(("body", "field"), [c[1:] for c in BAD_TOKENIZE], ids=[c[0] for c in BAD_TOKENIZE])
def test_invalid_tokenize_body_is_422_naming_the_field(client, body, field):
    assert_refused(client.post("/tokenize", json=body), 422, field)


OVER_LIMITS = [  # (id, route, body, field, limit)
    ("sentences", "/embed", {"sentences": ONE * (MAX_SENTENCES + 1)}, "sentences", MAX_SENTENCES),
    ("tokens", "/embed", {"sentences": [["a"], ["a"] * (MAX_TOKENS + 1)]}, "sentences[1]", MAX_TOKENS),
    ("tokens-of-string", "/embed", {"sentences": [" ".join(["a"] * (MAX_TOKENS + 1))]}, "sentences[0]", MAX_TOKENS),
    (
        "tokens-of-punctuated-string",
        "/embed",
        {"sentences": ["a," * (MAX_TOKENS // 2 + 1)]},
        "sentences[0]",
        MAX_TOKENS,
    ),  # one word by whitespace, 402 tokens by Moses
    ("openai-inputs", "/v1/embeddings", {"input": ["a"] * (MAX_SENTENCES + 1)}, "input", MAX_SENTENCES),
    ("openai-tokens", "/v1/embeddings", {"input": " ".join(["a"] * (MAX_TOKENS + 1))}, "input[0]", MAX_TOKENS),
    ("tokenize-sentences", "/tokenize", {"sentences": ONE * (MAX_SENTENCES + 1)}, "sentences", MAX_SENTENCES),
    ("tokenize-tokens", "/tokenize", {"sentences": [" ".join(["a"] * (MAX_TOKENS + 1))]}, "sentences[0]", MAX_TOKENS),
    # truncate spares a long sentence, not a request of too many
    ("truncate-sentences", "/embed", {"sentences": ONE * (MAX_SENTENCES + 1), "truncate": True}, "sentences",
     MAX_SENTENCES),
]  # fmt: skip


@pytest.mark.parametrize(
    ("route", "body", "field", "limit"), [c[1:] for c in OVER_LIMITS], ids=[c[0] for c in OVER_LIMITS]
)
def test_over_a_limit_is_413_with_the_limit(client, route, body, field, limit):  # 400 under /v1/
    detail = assert_refused(client.post(route, json=body), 413, field)
    assert f"limit is {limit}" in detail


def test_at_the_limits_is_served(client):
    body = embed(client, [["a"] * MAX_TOKENS] + ONE * (MAX_SENTENCES - 1), pooling="mean")
    assert body["usage"] == {"sentences": MAX_SENTENCES, "tokens": MAX_TOKENS + MAX_SENTENCES - 1}


@pytest.mark.parametrize("route", ["/embed", "/v1/embeddings"])
@pytest.mark.parametrize("streamed", [False, True], ids=["content-length", "chunked"])
def test_body_over_the_limit_is_413(client, route, streamed):
    text = json.dumps({"sentences": [["x" * 1000] * (MAX_BODY // 1000 + 1)]}).encode()
    assert len(text) > MAX_BODY
    content = (text[i : i + 16384] for i in range(0, len(text), 16384)) if streamed else text
    response = client.post(route, content=content, headers={"content-type": "application/json"})
    assert (response.request.headers.get("transfer-encoding") == "chunked") is streamed
    detail = assert_refused(response, 413, "body")
    assert str(MAX_BODY) in detail


def test_still_serving_after_the_errors(client):
    assert client.get("/health/ready").status_code == 200
    assert embed(client, [HELLO])["data"][0]["tokens"] == HELLO


# -- /v1/embeddings -------------------------------------------------------------------------------------------------


def test_openai_embeddings(client, tiny_model_dir):
    texts = ["Hello, world!", "The bank of the river."]
    single = client.post(
        "/v1/embeddings",
        json={"input": texts[0], "model": tiny_model_dir.name, "user": "ignored", "dimensions": DIM},
    )  # the model's own name and dimensions: accepted
    assert single.status_code == 200, single.text
    one = single.json()
    assert len(one["data"][0]["embedding"]) == DIM
    assert (one["object"], one["model"]) == ("list", tiny_model_dir.name)
    assert one["usage"] == {"prompt_tokens": 4, "total_tokens": 4}
    assert [(d["object"], d["index"]) for d in one["data"]] == [("embedding", 0)]

    many = {}
    for encoding in ("float", "base64"):
        response = client.post("/v1/embeddings", json={"input": texts, "encoding_format": encoding})
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["usage"] == {"prompt_tokens": 10, "total_tokens": 10}
        assert [d["index"] for d in body["data"]] == [0, 1]
        many[encoding] = [array({"embedding": d["embedding"], "shape": [DIM]}) for d in body["data"]]
    np.testing.assert_array_equal(many["float"], many["base64"])
    other = client.post("/v1/embeddings", json={"input": texts[0], "model": "text-embedding-3-small"})
    assert other.status_code == 404  # as OpenAI answers a model it does not have, in its shape
    assert other.json()["error"] == {
        "message": f"model: unknown model 'text-embedding-3-small'; this server serves: {tiny_model_dir.name}",
        "type": "invalid_request_error",
        "param": "model",
        "code": "model_not_found",
    }

    # Each input's vector: the mean over tokens of the equal-weights mix (the mean of the layers), gamma 1.
    layers = arrays(embed(client, texts, output="layers"))
    want = [h.astype(np.float64).mean(axis=(0, 1)) for h in layers]
    assert max_error(many["float"], want) <= 1e-6  # the same batch as the /embed request
    single = array({"embedding": one["data"][0]["embedding"], "shape": [DIM]})
    assert max_error([single], want[:1]) <= BATCH_TOLERANCE  # a batch of one


# -- health, info, metrics, docs ------------------------------------------------------------------------------------


def test_health(client):
    assert client.get("/health/live").json() == {"status": "live"}
    ready = client.get("/health/ready")
    assert ready.status_code == 200 and ready.json() == {"status": "ready"}


def test_info(client, server, tiny_model_dir):
    info = client.get("/info").json()
    assert (info["model"], info["dim"], info["num_layers"]) == (tiny_model_dir.name, DIM, NUM_LAYERS)
    assert info["provider"] == "CPUExecutionProvider"
    assert info["manifest"]["num_layers"] == NUM_LAYERS and info["manifest"]["output_dim"] == DIM
    assert info["manifest"]["parity"]["max_abs_error"] <= 1e-5
    # the CPU serves the Loop graph in fp32; the manifest lists the window graphs for CUDA and fp16 beside it
    assert info["precision"] == "fp32" and (info["graph"]["file"], info["graph"]["kind"]) == ("model.onnx", "loop")
    assert [g["precision"] for g in info["manifest"]["graphs"]] == ["fp32", "int8", "fp32", "fp16", "int8"]
    assert info["settings"]["precision"] == "fp32" and info["settings"]["cuda_graphs"] is False
    limits = info["limits"]
    assert (limits["max_sentences"], limits["max_tokens_per_sentence"]) == (MAX_SENTENCES, MAX_TOKENS)
    assert limits["max_body_bytes"] == MAX_BODY and limits["batch_tokens"] == 4096
    assert limits["max_inflight_bytes"] == 64 << 20 and limits["max_layers_or_mixes"] == 8
    assert limits["max_text_chars"] == 1_000_000 and limits["max_answer_bytes"] == 64 << 20
    assert limits["answer_bytes_per_number"] == {"float": 17, "base64": 16 / 3, "npz": 4}
    assert (limits["max_header_bytes"], limits["max_headers"]) == (16384, 100)
    assert (limits["head_timeout_s"], limits["body_timeout_s"], limits["body_min_rate"]) == (10, 10, 512 << 10)
    assert limits["max_inflight_bytes_per_client"] == 16 << 20 and limits["max_answers_inflight_bytes"] == 128 << 20
    assert (limits["write_timeout_s"], limits["max_pipelined"]) == (30, 16)
    settings = info["settings"]
    # folders by their names: the server's paths are not shown
    assert settings["port"] == server.port and settings["model_dir"] == tiny_model_dir.name
    assert str(tiny_model_dir) not in json.dumps(info)
    assert settings["max_sentences"] == MAX_SENTENCES and settings["provider"] == "cpu"
    assert settings["batch_tokens"] == 4096  # unset: the CPU provider's default, shown as in force
    assert settings["window"] == default_window(cpu_flags())  # unset: the host's (16 with AMX, else 8), in force
    assert settings["models"] == [[tiny_model_dir.name, tiny_model_dir.name]]  # the one model of ELMO_MODEL_DIR
    ((name, model),) = info["models"].items()
    assert name == tiny_model_dir.name and (model["dim"], model["num_layers"]) == (DIM, NUM_LAYERS)
    assert model["manifest"] == info["manifest"] and model["graph"] == info["graph"]
    assert (model["queue_tokens"], model["batch_tokens"], model["model_dir"]) == (65536, 4096, tiny_model_dir.name)
    assert model["window"] == settings["window"]
    assert client.get("/info", params={"model": name}).json() == info
    unknown = client.get("/info", params={"model": "x"})
    assert unknown.status_code == 404 and unknown.json()["detail"].startswith("model: unknown model 'x'")
    listed = client.get("/v1/models").json()
    assert listed["object"] == "list" and [m["id"] for m in listed["data"]] == [name]
    assert listed["data"][0] == {
        "id": name,
        "object": "model",
        "created": int((tiny_model_dir / "manifest.json").stat().st_mtime),
        "owned_by": "elmo-service",
        "dim": DIM,
        "num_layers": NUM_LAYERS,
    }
    assert client.get(f"/v1/models/{name}").json() == listed["data"][0]
    assert client.get("/v1/models/x").status_code == 404


@pytest.mark.parametrize("accept", ["application/json", "application/x-npz"])
def test_stage_metrics_time_each_stage_of_a_request(client, accept):
    stages = ("parse", "tokenize", "engine", "compose", "encode")
    before = {s: counter(client, "elmo_stage_seconds_count", stage=s) for s in stages}
    sums = {s: counter(client, "elmo_stage_seconds_sum", stage=s) for s in stages}
    response = client.post("/embed", json={"sentences": ["A text to tokenize.", HELLO]}, headers={"accept": accept})
    assert response.status_code == 200
    for s in stages:
        assert counter(client, "elmo_stage_seconds_count", stage=s) == before[s] + 1, s
        assert counter(client, "elmo_stage_seconds_sum", stage=s) >= sums[s], s
    embed(client, [HELLO])  # tokens: no tokenize stage
    assert counter(client, "elmo_stage_seconds_count", stage="tokenize") == before["tokenize"] + 1


def test_batch_tokens_default_to_the_providers():
    from service.settings import Settings, default_batch_tokens

    assert Settings().batch_tokens is None  # unset: decided once the engine's provider is known
    assert default_batch_tokens("CPUExecutionProvider") == 4096
    assert default_batch_tokens("CUDAExecutionProvider") == 65536
    assert Settings().public(batch_tokens=65536)["batch_tokens"] == 65536
    assert Settings(batch_tokens=512).public(batch_tokens=65536)["batch_tokens"] == 512  # set: kept


def test_metrics(client):
    before = counter(client, "elmo_requests_total", route="/embed", status="200")
    latency_before = counter(client, "elmo_request_seconds_count", route="/embed")
    embed(client, [HELLO])
    text = client.get("/metrics").text
    for name in (
        "elmo_requests_total",
        "elmo_request_seconds_bucket",
        "elmo_queue_tokens",
        "elmo_batch_sentences_bucket",
        "elmo_batch_tokens_bucket",
        "elmo_inference_seconds_count",
    ):
        assert name in text, name
    assert counter(client, "elmo_requests_total", route="/embed", status="200") == before + 1
    assert counter(client, "elmo_request_seconds_count", route="/embed") == latency_before + 1
    assert counter(client, "elmo_requests_total", route="/embed", status="422") > 0  # the error tests above
    assert counter(client, "elmo_batch_sentences_count") > 0 and counter(client, "elmo_inference_seconds_count") > 0
    assert counter(client, "elmo_queue_tokens") == 0  # nothing is waiting now
    model = client.get("/info").json()["model"]  # the per-model series carry the model's name
    for name in ("elmo_queue_tokens", "elmo_batch_sentences_count", "elmo_inference_seconds_count"):
        assert f'{name}{{model="{model}"}}' in text, name
    assert f'elmo_rejected_total{{model="{model}"}} 0.0' in text


def test_openapi_and_docs(client):
    paths = client.get("/openapi.json").json()["paths"]
    assert "post" in paths["/embed"] and "post" in paths["/v1/embeddings"] and "post" in paths["/tokenize"]
    embed_fields = client.get("/openapi.json").json()["components"]["schemas"]["EmbedRequest"]["properties"]
    assert {"unit_length", "truncate", "normalize"} <= set(embed_fields)
    for path in ("/health/live", "/health/ready", "/info", "/metrics", "/v1/models", "/v1/models/{model_id}"):
        assert path in paths
    docs = client.get("/docs")
    assert docs.status_code == 200 and "swagger" in docs.text.lower()
    openai_error = paths["/v1/embeddings"]["post"]["responses"]["400"]["content"]["application/json"]["schema"]
    assert openai_error == {"$ref": "#/components/schemas/OpenAIErrorResponse"}


@pytest.mark.parametrize("page", ["/docs", "/redoc"])
def test_the_docs_pages_load_everything_from_the_service(client, page):
    # Swagger UI and ReDoc from the package's files: the pages work where no CDN can be reached.
    html = client.get(page).text
    urls = re.findall(r'(?:src|href|spec-url)="([^"]+)"', html) + re.findall(r"url: '([^']+)'", html)
    assert "/openapi.json" in urls and any(u.endswith(".js") for u in urls)
    assert "//" not in "".join(urls) and "http" not in html.replace("http-equiv", "")  # nothing of another host
    for url in urls:
        answer = client.get(url)
        assert answer.status_code == 200 and len(answer.content) > 1000, url
    script = next(u for u in urls if u.endswith(".js"))
    assert ("SwaggerUIBundle" if page == "/docs" else "Redoc") in client.get(script).text


def test_by_default_no_keys_no_cors_and_no_request_text_in_the_log(client, server):
    secret = "Zyzzyva-unlogged-9902"
    sent = [  # (route, body, status): served, tokenized, invalid, over a limit, undecodable
        ("/embed", {"sentences": [[secret, "x"]]}, 200),
        ("/embed", {"sentences": [f"{secret} as text"]}, 200),
        ("/tokenize", {"sentences": [f"{secret} as text", [secret]]}, 200),
        ("/v1/embeddings", {"input": secret}, 200),
        ("/embed", {"sentences": [[secret]], "weights": [1.0]}, 422),
        ("/embed", {"sentences": [[secret]] * (MAX_SENTENCES + 1)}, 413),
        ("/embed", f'{{"sentences": [["{secret}"]]'.encode(), 422),
    ]
    for route, body, status in sent:
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        response = client.post(route, content=content, headers={"content-type": "application/json"})
        assert response.status_code == status, response.text
    from_a_page = client.post("/embed", json={"sentences": [["a"]]}, headers={"origin": "https://app.example"})
    assert from_a_page.status_code == 200 and "access-control-allow-origin" not in from_a_page.headers
    preflight = {"origin": "https://app.example", "access-control-request-method": "POST"}
    assert client.options("/embed", headers=preflight).status_code == 405  # no CORS middleware at all
    assert secret not in server.log.read_text()


def test_no_request_failed_on_the_server(client, server):
    """Last: nothing above made the server answer 5xx or log a traceback."""
    statuses = answered_statuses(client)
    assert statuses and not any(s.startswith("5") for s in statuses), statuses
    assert "Traceback" not in server.log.read_text()


def test_a_large_npz_answer_is_sent_in_parts_with_the_same_numbers(client, sentences):
    # 64 sentences of 60 tokens, per layer: 1.5 MB of float32, over the size encoded off the event loop
    big = [(sentences[k % 30] * 5)[:60] for k in range(64)]
    npz = npz_answer(client, big, output="layers")
    as_json = embed(client, big, output="layers", encoding="base64")
    assert sum(npz[f"embedding_{i}"].nbytes for i in range(64)) > 1 << 20
    for i, want in enumerate(arrays(as_json)):
        np.testing.assert_array_equal(npz[f"embedding_{i}"], want)
