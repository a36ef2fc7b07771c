"""The Python client (client/elmo_client) against real elmo-serve processes on 127.0.0.1: every parameter against
direct requests, inputs many times the server's limits split and put back in order, 413 split further, an
overloaded server retried until every answer is exact, a server that goes away, and the dependency claim
(httpx and numpy only). 429 comes from a stand-in server: elmo-serve never sends it."""

from __future__ import annotations

import asyncio
import base64
import json
import re
import subprocess
import sys
import textwrap
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import numpy as np
import pytest
from elmo_client import AsyncClient, Client, ElmoConnectionError, ElmoError, Limits
from elmo_client.chunks import estimated_tokens, plan
from elmo_client.wire import embed_body, sentence_bytes

from tests.conftest import max_error
from tests.live_server import counter, running_server, stop

MAX_SENTENCES, MAX_TOKENS, MAX_BODY, QUEUE_TOKENS = 4, 100, 1500, 300
SETTINGS = {
    "ELMO_MAX_SENTENCES": str(MAX_SENTENCES),
    "ELMO_MAX_TOKENS_PER_SENTENCE": str(MAX_TOKENS),
    "ELMO_MAX_BODY_BYTES": str(MAX_BODY),
    "ELMO_QUEUE_TOKENS": str(QUEUE_TOKENS),
    "ELMO_BATCH_TOKENS": "64",  # the engine takes little at a time, so concurrent callers fill the queue
}
NUM_LAYERS, DIM = 3, 32
TOLERANCE = 1e-6  # a sentence's vectors in another request (tests/e2e/test_api.py: the same bits on CPU)


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    with running_server(tiny_model_dir, tmp_path_factory.mktemp("client"), SETTINGS) as s:
        yield s


@pytest.fixture(scope="module")
def elmo(server):
    with Client(server.url) as c:
        yield c


def direct(http, sentences: list, **options) -> list[np.ndarray]:
    """Each sentence in a request of its own, straight over HTTP."""
    out = []
    for sentence in sentences:
        response = http.post("/embed", json={"sentences": [sentence], "encoding": "base64", **options})
        assert response.status_code == 200, response.text
        item = response.json()["data"][0]
        out.append(np.frombuffer(base64.b64decode(item["embedding"]), "<f4").reshape(item["shape"]))
    return out


def assert_same(got: list[np.ndarray], want: list[np.ndarray]) -> None:
    assert [g.shape for g in got] == [w.shape for w in want]
    assert all(g.dtype == np.float32 for g in got)
    assert max_error(got, want) <= TOLERANCE


def own_sentences(sentences, copies: int) -> list[list[str]]:
    """copies x the fixture's sentences, each made unique by a last token of its own."""
    return [[*sentences[k % len(sentences)], f"copy-{k}"] for k in range(copies * len(sentences))]


# -- numbers and parameters -----------------------------------------------------------------------------------------


def test_layers_equal_allennlp_across_many_requests(elmo, client, sentences, expected):
    before = counter(client, "elmo_requests_total", route="/embed", status="200")
    got = elmo.embed(sentences, output="layers")
    assert [g.shape for g in got] == [(NUM_LAYERS, len(s), DIM) for s in sentences]
    assert max_error(got, expected) <= 1e-5
    sent = counter(client, "elmo_requests_total", route="/embed", status="200") - before
    assert sent >= len(sentences) / MAX_SENTENCES  # the 30 sentences went in several requests
    assert (elmo.num_layers, elmo.dim, elmo.info()["limits"]["max_sentences"]) == (NUM_LAYERS, DIM, MAX_SENTENCES)


PARAMETERS = [
    pytest.param({}, id="default-mix"),
    pytest.param({"weights": [0.5, -1.0, 2.0], "gamma": 0.7}, id="weights-gamma"),
    pytest.param({"weights": [0.2, 0.3, 0.5], "normalize": "none", "layer_norm": True}, id="normalize-layer-norm"),
    pytest.param({"output": "layers", "layers": [2, 0]}, id="layers"),
    pytest.param({"output": "layers", "layers": [-1], "pooling": "mean"}, id="layers-mean"),
    pytest.param({"pooling": "mean", "unit_length": True}, id="mean-unit-length"),
    pytest.param({"mixes": [{"weights": [1.0, 2.0, 3.0]}, {"gamma": 2.0, "layer_norm": True}]}, id="mixes"),
    pytest.param({"output": "layers", "unit_length": True}, id="layers-unit-length"),
]


@pytest.mark.parametrize("options", PARAMETERS)
def test_every_parameter_gives_what_a_direct_request_gives(elmo, client, sentences, options):
    batch = [*sentences[:9], "A text, which the server tokenizes."]
    assert_same(elmo.embed(batch, **options), direct(client, batch, **options))


def test_the_npz_answer_where_offered_and_base64_where_not(server, sentences):
    batch = [*sentences[:4], "A text, which the server tokenizes."]
    got = {}
    for offered in (True, False):
        with Client(server.url) as c:
            c.info()
            if not offered:  # a server from before the .npz body
                c._info = {k: v for k, v in c._info.items() if k != "answer_media_types"}
            types = []
            c._http.event_hooks["response"].append(lambda r, types=types: types.append(r.headers["content-type"]))
            got[offered] = c.embed(batch, output="layers")
            assert set(types) == {"application/x-npz" if offered else "application/json"}
            assert all(a.dtype == np.float32 and a.flags.writeable for a in got[offered])
    for a, b in zip(got[True], got[False], strict=True):
        np.testing.assert_array_equal(a, b)  # the same bits either way


def test_float16_answers_over_npz_and_base64(server, sentences):
    batch = sentences[:4]
    with Client(server.url) as c:
        full = c.embed(batch, output="layers")
        half = c.embed(batch, output="layers", dtype="float16")
        c._info = {k: v for k, v in c.info().items() if k != "answer_media_types"}  # base64 in JSON
        half_b64 = c.embed(batch, output="layers", dtype="float16")
    for f, h, b in zip(full, half, half_b64, strict=True):
        assert h.dtype == np.float16 and b.dtype == np.float16 and h.flags.writeable
        np.testing.assert_array_equal(h, f.astype(np.float16))
        np.testing.assert_array_equal(b, h)


def test_the_async_client_reads_the_npz_answer(server, sentences):
    async def embed():
        async with AsyncClient(server.url) as c:
            assert "application/x-npz" in (await c.info())["answer_media_types"]["/embed"]
            return await c.embed(sentences[:3], pooling="mean")

    got = asyncio.run(embed())
    with Client(server.url) as c:
        c.info()
        c._info = {k: v for k, v in c._info.items() if k != "answer_media_types"}
        want = c.embed(sentences[:3], pooling="mean")
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(a, b)


def test_items_carry_tokens_and_truncation(elmo, client, sentences):
    long = [f"w{k}" for k in range(MAX_TOKENS + 7)]
    items = elmo.embed_items([sentences[0], long, "Hello, world!"], truncate=True, pooling="mean")
    assert [i.tokens for i in items] == [sentences[0], long[:MAX_TOKENS], ["Hello", ",", "world", "!"]]
    assert [(i.truncated, i.original_tokens) for i in items] == [
        (False, len(sentences[0])),
        (True, MAX_TOKENS + 7),
        (False, 4),
    ]
    assert_same([items[1].embedding], direct(client, [long[:MAX_TOKENS]], pooling="mean"))
    with pytest.raises(ElmoError) as refused:  # without truncate the server refuses it, and says why
        elmo.embed([long])
    assert refused.value.status == 413 and refused.value.detail.startswith("sentences[0]: 107 tokens")


def test_tokenize(elmo):
    data = elmo.tokenize(["Don't panic!", ["x" * 60], *(["a b"] * 9)])
    assert [d["tokens"] for d in data[:2]] == [["Don", "'t", "panic", "!"], ["x" * 60]]
    assert data[1]["kept_bytes"] == [48] and len(data) == 11  # 11 sentences: three requests, in order


def test_an_invalid_request_raises_the_servers_detail(elmo):
    with pytest.raises(ElmoError) as refused:
        elmo.embed([["a"]], weights=[1.0, 2.0])
    assert refused.value.status == 422 and refused.value.detail == "weights: 2 weights; the model has 3 layers"
    assert "422" in str(refused.value)
    with pytest.raises(TypeError):
        elmo.embed("one string")
    assert elmo.embed([]) == []


# -- limits ---------------------------------------------------------------------------------------------------------

CHUNKINGS = [  # what binds: the sentences per request, the body size, the queued tokens
    pytest.param(lambda s: [["a", f"s{k}"] for k in range(41)], id="sentences"),
    pytest.param(lambda s: [["x" * 120 + f"{k}-{j}" for j in range(5)] for k in range(9)], id="body-bytes"),
    pytest.param(lambda s: own_sentences(s, 2), id="tokens"),
]


@pytest.mark.parametrize("make", CHUNKINGS)
def test_an_input_many_times_the_limits_comes_back_in_order(server, client, sentences, make):
    batch = make(sentences)
    mixed = [" ".join(s) if k % 3 == 0 else s for k, s in enumerate(batch)]  # texts and token lists
    assert all(sentence_bytes(s) < MAX_BODY // 2 for s in mixed)
    refused = counter(client, "elmo_requests_total", route="/embed", status="413")
    with Client(server.url, max_concurrency=3) as elmo:
        items = elmo.embed_items(mixed, output="layers")
    assert [i.tokens for k, i in enumerate(items) if k % 3] == [s for k, s in enumerate(batch) if k % 3]
    assert_same([i.embedding for i in items], direct(client, mixed, output="layers"))
    assert counter(client, "elmo_requests_total", route="/embed", status="413") == refused  # planned, not refused


def test_requests_are_planned_under_the_answer_size_limit(tiny_model_dir, tmp_path, sentences, expected):
    # 30 000 bytes an answer: about 57 tokens of the tiny model's 3 layers of 32 in base64, so the 30 fixture
    # sentences (744 tokens) go in many requests, none of them refused.
    limit = {"ELMO_MAX_ANSWER_BYTES": "30000"}
    with running_server(tiny_model_dir, tmp_path, limit) as small, Client(small.url, max_concurrency=2) as elmo:
        assert max_error(elmo.embed(sentences, output="layers"), expected) <= 1e-5
        assert max_error(elmo.embed(sentences, output="layers", pooling="mean"), [e.mean(1) for e in expected]) <= 1e-5
        # with the boundaries: two vectors more a sentence, planned for too; an empty sentence is its boundaries
        kept = elmo.embed([*sentences, []], output="layers", boundaries=True)
        assert [k.shape[1] for k in kept] == [len(s) + 2 for s in sentences] + [2]
        assert max_error([k[:, 1:-1] for k in kept[:-1]], expected) <= 1e-5
        with httpx.Client(base_url=small.url) as http:
            assert counter(http, "elmo_requests_total", route="/embed", status="413") == 0
            assert counter(http, "elmo_requests_total", route="/embed", status="200") >= 744 * 521 // 30000 + 1


def test_a_request_answered_413_is_split_until_it_fits(server, client):
    # Each text is one word to the plan but 95 tokens to Moses: four of them (388 queued tokens) are over the
    # queue's 300, so the first request is refused with 413, and its halves are served.
    texts = ["x," * 47 + f"end{k}" for k in range(4)]
    refused = counter(client, "elmo_requests_total", route="/embed", status="413")
    with Client(server.url, max_concurrency=1) as elmo:
        got = elmo.embed(texts, pooling="mean")
    assert counter(client, "elmo_requests_total", route="/embed", status="413") == refused + 1
    assert_same(got, direct(client, texts, pooling="mean"))


def test_the_plan_keeps_every_limit():
    limits = Limits(max_sentences=3, max_tokens_per_sentence=10, max_body_bytes=200, queue_tokens=1000)
    sentences = [["a"] * (k % 12 + 1) for k in range(50)] + ["one two three"] * 5 + [["y" * 300]]
    fixed = len(embed_body([], {"output": "layers"}))
    for truncate in (False, True):
        runs = plan(sentences, limits, fixed, tokens_per_request=30, truncate=truncate)
        assert [i for r in runs for i in r] == list(range(len(sentences)))  # all of them, in order
        for r in runs[:-1]:
            run = [sentences[i] for i in r]
            assert len(run) <= 3
            assert len(embed_body(run, {"output": "layers"})) <= 200
            counts = [min(estimated_tokens(s), 10) if truncate else estimated_tokens(s) for s in run]
            assert len(run) == 1 or sum(c + 2 for c in counts) <= 30
        assert runs[-1] == range(len(sentences) - 1, len(sentences))  # over the body limit: alone


def test_the_plan_counts_the_boundaries_vectors_in_the_answer():
    # two sentences of 28 tokens fit an answer of 30 000 bytes at 521 a vector (56 x 521), not with their
    # boundaries (60 x 521)
    limits, sentences = Limits(max_answer_bytes=30_000), [["w"] * 28] * 4
    fixed = len(embed_body([], {"output": "layers", "boundaries": True}))
    assert plan(sentences, limits, fixed, 1000, False, vector=521) == [range(0, 2), range(2, 4)]
    assert plan(sentences, limits, fixed, 1000, False, vector=521, extra_positions=2) == [
        range(k, k + 1) for k in range(4)
    ]


# -- overload, 429, a server that goes away -------------------------------------------------------------------------


def test_an_overloaded_server_is_retried_until_every_answer_is_exact(server, client, sentences, expected):
    rejected = counter(client, "elmo_rejected_total")
    callers = 6
    results: list = [None] * callers
    shared = Client(server.url, max_concurrency=4)  # half the callers share one client (and its 4 connections)

    def call(k: int) -> None:
        if k % 2:
            results[k] = shared.embed(sentences, output="layers")
            return
        with Client(server.url, max_concurrency=4) as elmo:
            results[k] = elmo.embed(sentences, output="layers")

    threads = [threading.Thread(target=call, args=(k,)) for k in range(callers)]
    for t in threads:
        t.start()

    async def more():  # and the async client beside them
        async with AsyncClient(server.url, max_concurrency=4) as elmo:
            return await asyncio.gather(*(elmo.embed(sentences, output="layers") for _ in range(2)))

    async_results = asyncio.run(more())
    for t in threads:
        t.join(timeout=120)
    shared.close()
    for got in [*results, *async_results]:
        assert got is not None and max_error(got, expected) <= 1e-5
    assert counter(client, "elmo_rejected_total") > rejected  # there was something to retry


class StandIn:
    """A server on 127.0.0.1 that answers /embed from a script of statuses (then 200), for what elmo-serve never
    sends: 429 Too Many Requests comes from a rate-limiting proxy or gateway in front of it."""

    def __init__(self, script: list[tuple[int, dict]]):
        self.script, self.seen = list(script), []
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def answer(self, status: int, body: dict, headers: dict | None = None):
                data = json.dumps(body).encode()
                self.send_response(status)
                for name, value in {"content-type": "application/json", **(headers or {})}.items():
                    self.send_header(name, value)
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self.answer(200, {"num_layers": 1, "dim": 2, "limits": {"max_sentences": 8}})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                stand_in.seen.append((time.monotonic(), dict(self.headers), body))
                if stand_in.script:
                    status, headers = stand_in.script.pop(0)
                    return self.answer(status, {"detail": f"scripted {status}"}, headers)
                data = [
                    {"index": i, "tokens": s, "shape": [2],
                     "embedding": base64.b64encode(np.array([i, len(s)], "<f4").tobytes()).decode()}
                    for i, s in enumerate(body["sentences"])
                ]  # fmt: skip
                self.answer(200, {"data": data})

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}"
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.http.shutdown()
        self.http.server_close()


@pytest.mark.parametrize("url", ["localhost:8000", "127.0.0.1:8000", "ftp://127.0.0.1:8000", "http://"])
def test_a_url_without_a_scheme_or_host_is_refused_at_once(url):
    for client in (Client, AsyncClient):
        with pytest.raises(ValueError, match=r"give the scheme and the host, e\.g\. http://\S"):
            client(url)  # before any connection: no retries of a URL that cannot work


def test_429_and_503_are_retried_after_retry_after():
    script = [(429, {"retry-after": "1"}), (503, {"retry-after": "0"})]
    with StandIn(script) as stand_in, Client(stand_in.url, api_key="sekrit") as elmo:
        got = elmo.embed([["a", "b"], ["c"]])
    (first, headers, body), (second, _, _), (third, _, _) = stand_in.seen
    assert 0.95 <= second - first < 1.5 + 0.5 and third - second < 0.5  # Retry-After: 1 (+ up to 50%), then 0
    assert headers["authorization"] == "Bearer sekrit" and body["encoding"] == "base64"
    np.testing.assert_array_equal(got, [[0, 2], [1, 1]])


def test_the_wait_for_retries_is_bounded_and_the_error_says_why():
    with StandIn([(503, {"retry-after": "1"})] * 10) as stand_in, Client(stand_in.url, retry_wait_s=3.2) as elmo:
        started = time.monotonic()
        with pytest.raises(ElmoError) as refused:
            elmo.embed([["a"]])
        seconds = time.monotonic() - started
    assert refused.value.status == 503 and refused.value.detail == "scripted 503"
    # Waits of 1 to 1.5 s each: two or three of them fit in 3.2 s, never four.
    assert 3 <= len(stand_in.seen) <= 4 and 2 <= seconds < 3.2 + 1
    assert re.search(r"gave up after waiting [23]\.\d s in all", str(refused.value)), str(refused.value)


def test_a_server_that_goes_away(tiny_model_dir, tmp_path, sentences, expected):
    small = {"ELMO_MAX_SENTENCES": "4"}  # so a large input is many requests, one after the other
    with running_server(tiny_model_dir, tmp_path, small) as gone, Client(gone.url, max_concurrency=1) as elmo:
        assert max_error(elmo.embed(sentences[:3], output="layers"), expected[:3]) <= 1e-5
        outcome: list = []

        def big():
            try:
                outcome.append(elmo.embed(sentences * 40, output="layers"))  # 300 requests
            except ElmoError as err:
                outcome.append(err)

        worker = threading.Thread(target=big)
        worker.start()
        with httpx.Client(base_url=gone.url) as http:  # stopped mid-use: after a few of its requests
            deadline = time.monotonic() + 30
            while counter(http, "elmo_requests_total", route="/embed", status="200") < 5:
                assert time.monotonic() < deadline, "the client sent nothing"
                time.sleep(0.01)
        stop(gone.proc)
        worker.join(timeout=60)
        assert not worker.is_alive()  # it neither hangs nor answers half: it raises, and says why
        (error,) = outcome
        assert isinstance(error, ElmoConnectionError), error
        assert "cannot reach the server" in str(error) and "after 4 tries" in str(error)
        started = time.monotonic()
        with pytest.raises(ElmoConnectionError, match="cannot reach the server"):
            elmo.embed(sentences[:1])
        assert time.monotonic() - started < 5  # 0.25 s, 0.5 s and 1 s between four tries


# -- the dependency claim -------------------------------------------------------------------------------------------

ISOLATED = textwrap.dedent(
    """
    import importlib.abc, json, sys

    BLOCKED = {"fastapi", "uvicorn", "starlette", "pydantic", "pydantic_settings", "onnxruntime", "torch", "h5py",
               "service", "model_export", "sacremoses", "orjson", "prometheus_client"}

    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.partition(".")[0] in BLOCKED:
                raise ImportError(f"blocked: {name}")
            return None

    sys.meta_path.insert(0, Block())
    import elmo_client
    from elmo_client.allennlp import ElmoEmbedder

    with elmo_client.Client(sys.argv[1]) as client:
        layers = client.embed(json.loads(sys.argv[2]), output="layers")
    adapter = ElmoEmbedder(url=sys.argv[1])
    first = adapter.embed_sentence(json.loads(sys.argv[2])[0])
    loaded = sorted({m.partition(".")[0] for m in sys.modules} & BLOCKED)
    print(json.dumps({"layers": [x.tolist() for x in layers], "first": first.tolist(), "loaded": loaded}))
    """
)


def test_the_client_needs_only_httpx_and_numpy(server, sentences, expected, tmp_path):
    run = subprocess.run(
        [sys.executable, "-c", ISOLATED, server.url, json.dumps(sentences[:2])],
        capture_output=True,
        text=True,
        cwd=tmp_path,  # not the repository root: nothing of it is on the path but what is installed
        timeout=120,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    answer = json.loads(run.stdout)
    assert answer["loaded"] == []
    got = [np.asarray(x, np.float32) for x in answer["layers"]]
    assert max_error(got, expected[:2]) <= 1e-5
    np.testing.assert_array_equal(np.asarray(answer["first"], np.float32), got[0])


def test_an_unreadable_answer_is_an_elmo_error():
    # A body cut short (a proxy's limit, say) is the client's error to name, not a zipfile or JSON traceback.
    from elmo_client.client import _answer

    request = httpx.Request("POST", "http://127.0.0.1:1/embed")
    for kind, content in (("application/x-npz", b"PK\x03\x04cut short"), ("application/json", b'{"data": [')):
        with pytest.raises(ElmoError, match=f"unreadable {kind} answer"):
            _answer(httpx.Response(200, content=content, headers={"content-type": kind}, request=request))
