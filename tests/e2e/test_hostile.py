"""Hostile bodies against a real elmo-serve with the default limits, one table row each: every one is answered
in seconds with a 4xx whose `detail` starts with the field at fault (or, where the body is valid however odd,
200 with the right numbers), never a 5xx or a hang, and the server stays ready throughout."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import socket
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
import numpy as np
import pytest

from tests.live_server import (
    answered_statuses,
    peak_rss_bytes,
    raw_exchange,
    refusal,
    rss_bytes,
    running_server,
    status_on,
)

ANSWER_S = 10  # the slowest row answers in well under a second here; a hang or a quadratic path does not
MILLION = "x" * 1_000_000
BOMB = "a," * 4_000_000  # 8 MB, one word by whitespace, 8 million tokens by Moses
DEEP = 5000


def js(obj) -> bytes:
    return json.dumps(obj, ensure_ascii=False).encode()


def nested(opening: bytes, closing: bytes, inner: bytes = b"") -> bytes:
    return opening * DEEP + inner + closing * DEEP


@dataclass(frozen=True)
class Case:
    id: str
    body: Callable[[], bytes | object]  # raw bytes, or an iterator of chunks (sent chunked); made when run
    status: int  # as /embed answers it (under /v1/: OpenAI's, tests.server.status_on)
    field: str  # what `detail` (under /v1/: `error.message`) starts with; for 200, unused
    route: str = "/embed"
    served_like: list[list[str]] | None = None  # 200: the layers must be those of these sentences


CASES = [
    # Valid however odd: served, with the numbers the published char mapping gives (48 bytes of a token kept).
    Case("million-char-token", lambda: js({"sentences": [[MILLION, "end"]], "output": "layers"}), 200, "",
         served_like=[["x" * 48, "end"]]),
    Case("million-char-multibyte-token", lambda: js({"sentences": [["é" * 1_000_000]], "output": "layers"}), 200,
         "", served_like=[["é" * 24]]),
    Case("million-char-text", lambda: js({"sentences": [MILLION], "output": "layers"}), 200, "",
         served_like=[["x" * 48]]),
    Case("million-char-openai-input", lambda: js({"input": MILLION}), 200, "", route="/v1/embeddings"),
    Case("nul-and-control-tokens", lambda: js({"sentences": [["a\x00b", "\x01", "\x1f\x7f", "tab\tin"]],
         "output": "layers"}), 200, "", served_like=[["a\x00b", "\x01", "\x1f\x7f", "tab\tin"]]),
    Case("control-chars-in-text", lambda: js({"sentences": ["a\x00b \x07c\x1b"], "output": "layers"}), 200, "",
         served_like=[["ab", "c"]]),  # Moses deletes ASCII control characters
    # Over a request limit: 413 naming the limit, before any tokenizing or encoding.
    Case("100k-sentences", lambda: js({"sentences": [["a"]] * 100_000}), 413, "sentences"),
    Case("100k-texts", lambda: js({"sentences": ["a b"] * 100_000}), 413, "sentences"),
    Case("100k-openai-inputs", lambda: js({"input": ["a"] * 100_000}), 413, "input", route="/v1/embeddings"),
    Case("20k-token-sentence", lambda: js({"sentences": [["a"], ["a"] * 20_000]}), 413, "sentences[1]"),
    Case("20k-word-text", lambda: js({"sentences": [" ".join(["U.S.", "don't", "(x)"] * 7000)]}), 413,
         "sentences[0]"),  # Moses would take seconds on it
    # truncate: a sentence far over the limit is cut to it (a list at once; a text is still read whole)
    Case("100k-token-sentence-truncated", lambda: js({"sentences": [["a"] * 100_000], "truncate": True,
         "output": "layers"}), 200, "", served_like=[["a"] * 1000]),
    Case("million-char-token-tokenized", lambda: js({"sentences": [[MILLION]]}), 200, "", route="/tokenize"),
    Case("100k-tokenize-sentences", lambda: js({"sentences": [["a"]] * 100_000}), 413, "sentences",
         route="/tokenize"),
    # Text whose words (by whitespace) are few but whose tokens are many: refused before Moses reads it.
    Case("punctuation-bomb-text", lambda: js({"sentences": [BOMB]}), 413, "sentences[0]"),  # Moses: 13 s, 2 GB
    Case("punctuation-dense-text", lambda: js({"sentences": ["a," * 400_000]}), 413, "sentences[0]"),
    Case("punctuation-dense-openai", lambda: js({"input": ["fine", "." * 900_000]}), 413, "input[1]",
         route="/v1/embeddings"),
    Case("text-over-a-million-chars", lambda: js({"sentences": ["x" * 1_000_001]}), 413, "sentences[0]"),
    # truncate reads at most 16 times the limit: a bomb is still refused before Moses, a long text is cut
    Case("punctuation-bomb-truncated", lambda: js({"sentences": [BOMB], "truncate": True}), 413, "sentences[0]"),
    Case("punctuation-text-truncated", lambda: js({"sentences": ["a," * 5000], "truncate": True, "output": "layers"}),
         200, "", served_like=[["a", ","] * 500]),
    # Tokens Moses read slowly (0.9 ms each: "a.a." ends in a full stop), within the bounds: 200 KB of them.
    Case("a.a.-texts-truncated", lambda: js({"sentences": ["a.a. " * 4000] * 10, "truncate": True}), 200, "",
         route="/tokenize"),
    Case("more-tokens-than-the-queue", lambda: js({"sentences": [["a"] * 200] * 512}), 413, "sentences"),
    # Over the queue however truncate cuts them (100 of 1000 + 2 tokens at least): refused on their words by
    # whitespace, before the upper bound counted 16,000 of each (0.7 to 2.1 s for 8 MB).
    Case("hopeless-tokenize-truncated", lambda: js({"sentences": [" ".join(["word"] * 16_000)] * 100,
         "truncate": True}), 413, "sentences: at least 100200 tokens", route="/tokenize"),
    # An answer over 64 MiB (512 x 126 tokens, 8 copies: 1.4 GB of JSON once, 12 s of the event loop).
    Case("answer-of-8-mixes", lambda: js({"sentences": [["a"] * 126] * 512, "mixes": [{}] * 8}), 413, "sentences"),
    Case("answer-of-8-layers", lambda: js({"sentences": [["a"] * 126] * 512, "output": "layers",
         "layers": [0, 1, 2, 0, 1, 2, 0, 1]}), 413, "sentences"),
    Case("body-over-8-MiB", lambda: js({"sentences": [["x" * 1000] * 9000]}), 413, "body"),
    Case("body-over-8-MiB-chunked", lambda: iter([b'{"sentences": [["'] + [b"x" * 65536] * 140 + [b'"]]}']), 413,
         "body"),
    # Text that is not valid Unicode or JSON.
    Case("raw-nul-in-json", lambda: b'{"sentences": [["a\x00b"]]}', 422, "body"),
    Case("lone-surrogate-token", lambda: b'{"sentences": [["ok"], ["a", "\\ud800"]]}', 422, "sentences[1]"),
    Case("lone-surrogate-text", lambda: b'{"sentences": ["abc \\udfff"]}', 422, "sentences[0]"),
    Case("lone-surrogate-openai", lambda: b'{"input": ["fine", "\\udbff"]}', 422, "input[1]",
         route="/v1/embeddings"),
    Case("invalid-utf8", lambda: b'{"sentences": [["\xff\xfe"]]}', 422, "body"),
    Case("overlong-utf8", lambda: b'{"sentences": [["\xc0\xaf"]]}', 422, "body"),
    Case("truncated-utf8", lambda: b'{"sentences": [["\xe2\x82"]]}', 422, "body"),
    Case("utf8-encoded-surrogate", lambda: b'{"sentences": [["\xed\xa0\x80"]]}', 422, "sentences[0]"),
    Case("nested-5000-arrays", lambda: b'{"sentences": ' + nested(b"[", b"]") + b"}", 422, "body"),
    Case("nested-5000-objects", lambda: b'{"sentences": ' + nested(b'{"a": ', b"}", b"1") + b"}", 422, "body"),
    Case("nested-5000-openai", lambda: b'{"input": ' + nested(b"[", b"]") + b"}", 422, "body",
         route="/v1/embeddings"),
    Case("nested-500-arrays", lambda: b'{"sentences": ' + b"[" * 500 + b"]" * 500 + b"}", 422, "sentences"),
    # Wrong types and shapes.
    Case("sentences-object", lambda: js({"sentences": {"a": ["b"]}}), 422, "sentences"),
    Case("token-number", lambda: js({"sentences": [["a", 1]]}), 422, "sentences"),
    Case("output-number", lambda: js({"sentences": [["a"]], "output": 1}), 422, "output"),
    Case("pooling-null", lambda: js({"sentences": [["a"]], "pooling": None}), 422, "pooling"),
    Case("mixes-string", lambda: js({"sentences": [["a"]], "mixes": "two"}), 422, "mixes"),
    Case("openai-input-object", lambda: js({"input": {"text": "a"}}), 422, "input", route="/v1/embeddings"),
    Case("top-level-list", lambda: js([["a"]]), 422, "body"),
    Case("top-level-string", lambda: js("a"), 422, "body"),
    Case("top-level-null", lambda: b"null", 422, "body"),
    Case("empty-body", lambda: b"", 422, "body"),
    Case("empty-body-openai", lambda: b"", 422, "body", route="/v1/embeddings"),
    Case("whitespace-body", lambda: b" \r\n\t ", 422, "body"),
    # Huge and non-finite numbers.
    Case("gamma-1e400", lambda: b'{"sentences": [["a"]], "gamma": 1e400}', 422, "gamma"),
    Case("gamma-minus-1e400", lambda: b'{"sentences": [["a"]], "gamma": -1e400}', 422, "gamma"),
    Case("weight-1e308", lambda: b'{"sentences": [["a"]], "weights": [1e308, 0, 0]}', 422, "weights"),
    Case("nan-weight", lambda: b'{"sentences": [["a"]], "weights": [NaN, 0, 0]}', 422, "weights"),
    Case("infinity-in-a-mix", lambda: b'{"sentences": [["a"]], "mixes": [{"gamma": Infinity}]}', 422, "mixes"),
    Case("int-of-5000-digits", lambda: b'{"sentences": [["a"]], "output": "layers", "layers": [' + b"9" * 5000
         + b"]}", 422, "body"),
    Case("int-of-30-digits", lambda: b'{"sentences": [["a"]], "output": "layers", "layers": [' + b"9" * 30
         + b"]}", 422, "layers[0]"),
    Case("float-layer-1e30", lambda: b'{"sentences": [["a"]], "output": "layers", "layers": [1e30]}', 422,
         "layers"),
    # Lists that would multiply the answer, or the error report.
    Case("no-layers", lambda: js({"sentences": [["a"]], "output": "layers", "layers": []}), 422, "layers"),
    Case("openai-dimensions-not-the-model-s", lambda: js({"input": "a", "dimensions": 8}), 422, "dimensions",
         route="/v1/embeddings"),
    Case("10k-layers", lambda: js({"sentences": [["a"]], "output": "layers", "layers": [0] * 10_000}), 422,
         "layers"),
    Case("10k-mixes", lambda: js({"sentences": [["a"]], "mixes": [{}] * 10_000}), 422, "mixes"),
    Case("1m-weights", lambda: js({"sentences": [["a"]], "weights": [0.0] * 1_000_000}), 422, "weights"),
    Case("100k-wrong-tokens", lambda: js({"sentences": [[1] * 100_000]}), 422, "sentences"),
    # A million wrong items, where each was an error object built on the event loop (8 s, +850 MB for 2 MB).
    Case("million-integer-tokens", lambda: b'{"sentences": [[' + b"1," * 999_999 + b'1]]}', 422, "sentences.0"),
    # Counted before they are built (issue 39): over the sentence limit, 413, not the first wrong item's 422.
    Case("million-nulls", lambda: b'{"sentences": [' + b"null," * 999_999 + b"null]}", 413, "sentences"),
    Case("million-null-weights", lambda: b'{"sentences": [["a"]], "weights": [' + b"null," * 999_999 + b"null]}",
         422, "weights.0"),
    Case("million-null-openai-inputs", lambda: b'{"input": [' + b"null," * 999_999 + b"null]}", 422, "input",
         route="/v1/embeddings"),
    Case("million-null-tokenize", lambda: b'{"sentences": [' + b"null," * 999_999 + b"null]}", 413, "sentences",
         route="/tokenize"),
    Case("100k-unknown-fields", lambda: js({"sentences": [["a"]], **{f"f{i}": 1 for i in range(100_000)}}), 422,
         "f0"),
    Case("megabyte-field-name", lambda: js({"sentences": [["a"]], MILLION: 1}), 422, "x" * 64 + "..."),
]  # fmt: skip


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    with running_server(tiny_model_dir, tmp_path_factory.mktemp("hostile")) as s:  # the default limits
        yield s


def layers_of(item: dict) -> np.ndarray:
    return np.asarray(item["embedding"], dtype=np.float32)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_hostile_body(client, engine, case):
    content = case.body()
    start = time.monotonic()
    response = client.post(case.route, content=content, headers={"content-type": "application/json"})
    seconds = time.monotonic() - start
    assert response.status_code == status_on(case.route, case.status), response.text[:500]
    assert response.headers["content-type"].startswith("application/json")
    assert seconds < ANSWER_S
    if case.status == 200:
        if case.served_like is not None:
            data = response.json()["data"]
            want = engine.run(case.served_like)
            for item, expected in zip(data, want, strict=True):
                np.testing.assert_allclose(layers_of(item), expected, rtol=0, atol=1e-6)
    else:
        detail = refusal(response)
        assert isinstance(detail, str) and detail.startswith(case.field), detail[:500]
        assert len(response.content) < 10_000  # the answer names the problem; it does not echo the body
        if case.status == 413:
            assert "limit" in detail
    assert client.get("/health/ready").status_code == 200


def test_echoed_tokens_are_the_ones_sent(client):
    # The million-character token comes back whole in `tokens` (the vectors use its first 48 bytes).
    body = client.post("/embed", json={"sentences": [[MILLION, "\x00"]], "pooling": "mean", "encoding": "base64"})
    item = body.json()["data"][0]
    assert item["tokens"] == [MILLION, "\x00"] and item["shape"] == [32]
    assert len(base64.b64decode(item["embedding"])) == 32 * 4


def test_an_error_report_stops_at_a_list_s_first_wrong_item(client):
    # A million wrong items cost what one does: the list's first wrong token, and "not a string either".
    response = client.post("/embed", json={"sentences": [["a"], [1] * 1000]})
    body = response.json()
    assert response.status_code == 422 and "more_errors" not in body
    assert [e["loc"] for e in body["errors"]] == [["body", "sentences", 1, "list[str]", 0], ["body", "sentences", 1,
                                                                                               "str"]]  # fmt: skip
    assert body["detail"] == "sentences.1.list[str].0: Input should be a valid string"


def test_a_long_error_report_is_cut_and_counted(client):
    # 11 unknown fields are looked at (of 100), and the list's first wrong token: 10 listed, 3 counted.
    response = client.post("/embed", json={"sentences": [[1] * 1000], **{f"f{i}": 1 for i in range(100)}})
    body = response.json()
    assert response.status_code == 422 and len(body["errors"]) == 10
    assert body["more_errors"] == 3


def test_no_server_error_and_still_ready_after_all_of_them(client, server):
    statuses = answered_statuses(client)
    assert statuses and not any(s.startswith("5") for s in statuses), statuses
    assert client.get("/health/ready").status_code == 200
    assert "Traceback" not in server.log.read_text()
    assert rss_bytes(server.pid) < 1 << 30  # a million characters here and there, not gigabytes


def request_head(path: str = "/health/live", extra: bytes = b"") -> bytes:
    return b"GET " + path.encode() + b" HTTP/1.1\r\nhost: 127.0.0.1\r\n" + extra + b"\r\n"


@pytest.mark.parametrize(
    ("extra", "detail"),
    [
        (b"x-big: " + b"a" * 1_000_000 + b"\r\n", "headers: the request line and headers are over the limit of 16384"),
        (b"x-a: b\r\n" * 10_000, "headers: over 100 of them; the limit is 100"),
        (b"x-a: b\r\n" * 100, "headers: over 100 of them"),  # with host: 101
    ],
    ids=["one-megabyte-header", "10000-headers", "101-headers"],
)
def test_a_request_head_over_the_limits_is_431(server, client, extra, detail):
    start = time.monotonic()
    ((status, headers, body),) = raw_exchange(server.port, request_head(extra=extra), answers=2)
    assert time.monotonic() - start < ANSWER_S
    assert status == 431 and headers["connection"] == "close", body
    assert json.loads(body)["detail"].startswith(detail)
    assert client.get("/health/ready").status_code == 200


def test_a_request_head_at_the_limits_is_served(server):
    extra = b"x-a: b\r\n" * 98 + b"x-big: " + b"a" * (16384 - 98 * 8 - 100) + b"\r\n"  # 100 headers, near 16 KiB
    ((status, _, body),) = raw_exchange(server.port, request_head(extra=extra), answers=1)
    assert status == 200 and json.loads(body) == {"status": "live"}


def test_pipelined_requests_before_garbage_are_answered_in_order(server, engine):
    embed = js({"sentences": [["pipelined", "first"]], "output": "layers"})
    post = (
        b"POST /embed HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
        + f"content-length: {len(embed)}\r\n\r\n".encode()
        + embed
    )
    answers = raw_exchange(server.port, request_head() + post + b"NOT HTTP AT ALL\r\n\r\n", answers=4)
    assert [status for status, _, _ in answers] == [200, 200, 400]  # and then the connection closed
    assert json.loads(answers[0][2]) == {"status": "live"}
    (item,) = json.loads(answers[1][2])["data"]
    np.testing.assert_allclose(layers_of(item), engine.run([["pipelined", "first"]])[0], rtol=0, atol=1e-6)
    assert answers[2][1]["connection"] == "close" and json.loads(answers[2][2])["detail"].startswith("request: ")


def test_eight_punctuation_bombs_at_once_are_refused_in_bounded_memory(server, client):
    body = js({"sentences": [BOMB]})

    def post(k):
        # each from an address of its own: one address may hold 16 MiB of bodies in flight, two of these
        start = time.monotonic()
        with httpx.Client(transport=httpx.HTTPTransport(local_address=f"127.0.0.{k + 2}"), timeout=60) as own:
            response = own.post(f"{server.url}/embed", content=body, headers={"content-type": "application/json"})
        return response, time.monotonic() - start

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(post, range(8)))
    for response, seconds in answers:
        assert response.status_code == 413 and response.json()["detail"].startswith("sentences[0]: 8000000 char")
        assert seconds < ANSWER_S
    assert peak_rss_bytes(server.pid) < 1 << 30  # was 2.75 GB: Moses made 8 million tokens of each
    assert client.get("/health/ready").status_code == 200


def test_moses_never_runs_on_a_text_that_is_refused(tiny_model_dir, monkeypatch):
    from service.api.app import create_app
    from service.settings import Settings
    from service.tokenizing import TokenizingProcess

    read = []  # the lengths of the texts Moses was given: what the tokenizing threads hand their processes
    handed = TokenizingProcess.__call__

    def spy(process, text, language):
        read.append(len(text))
        return handed(process, text, language)

    monkeypatch.setattr(TokenizingProcess, "__call__", spy)
    settings = Settings(model_dir=tiny_model_dir, provider="cpu", intra_op_threads=1, inter_op_threads=1)
    app = create_app(settings)

    async def send_all():  # in this process, so that the spy sees every text handed on
        async with (
            app.router.lifespan_context(app),
            httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://app") as client,
        ):
            for text in [BOMB, "a," * 400_000, "x" * 1_000_001, "(x) " * 600]:  # the last: 600 words, 1800 tokens
                response = await client.post("/embed", json={"sentences": ["fine", text]})
                assert response.status_code == 413 and response.json()["detail"].startswith("sentences[1]: ")
            assert (await client.post("/embed", json={"sentences": ["a b", ["c"]]})).status_code == 200

    asyncio.run(send_all())
    assert read == [3]  # only the text of the request that was served


def chunked(path: str, body: bytes, trailer: bytes = b"", size_line: bytes | None = None) -> bytes:
    head = (
        f"POST {path} HTTP/1.1\r\nhost: [::1]\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n"
    )
    size = b"%x" % len(body) if size_line is None else size_line
    return head.encode() + size + b"\r\n" + body + b"\r\n0\r\n" + trailer + b"\r\n"


def test_a_trailer_never_acts_as_a_header(server):
    data = chunked("/embed", js({"sentences": [["a"]]}), trailer=b"accept: application/x-npz\r\n")
    ((status, headers, body),) = raw_exchange(server.port, data, answers=1)
    assert status == 200 and headers["content-type"] == "application/json", headers  # not the .npz it asks for
    assert json.loads(body)["data"][0]["tokens"] == ["a"]


@pytest.mark.parametrize(
    ("data", "status", "detail"),
    [
        (chunked("/embed", b'{"sentences": [["a"]]}', size_line=b"zz"), 400, "request: not valid HTTP/1.1"),
        (chunked("/embed", b'{"sentences": [["a"]]}', trailer=b"x-t: 1\r\n" * 1000), 431, "trailers: over the limit"),
    ],
    ids=["malformed-chunk-size", "1000-trailers"],
)
def test_a_malformed_body_is_answered_at_once(server, client, data, status, detail):
    # The request is being answered (its app waits for its body): it got 408 after the body timeout (10 s).
    start = time.monotonic()
    ((got, headers, body),) = raw_exchange(server.port, data, answers=2)
    assert time.monotonic() - start < 2
    assert got == status and headers["connection"] == "close", body
    assert json.loads(body)["detail"].startswith(detail)
    assert client.get("/health/ready").status_code == 200


def test_pipelined_requests_that_are_never_read_hold_bounded_memory(server, client):
    # 6,898 GETs in 256 KiB, on 30 connections that never read: uvicorn queued them all (+970 MB for 60).
    pipelined = request_head() * (256 * 1024 // len(request_head()))
    before = rss_bytes(server.pid)
    socks = []
    for _ in range(30):
        sock = socket.create_connection(("127.0.0.1", server.port))
        sock.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            sock.send(pipelined)  # as much as the kernel takes; the server reads it as it parses
        socks.append(sock)
    time.sleep(1)
    seconds = []
    for _ in range(10):
        start = time.monotonic()
        assert client.post("/embed", json={"sentences": [["small"]]}).status_code == 200
        seconds.append(time.monotonic() - start)
    grown = rss_bytes(server.pid) - before
    for sock in socks:
        sock.close()
    print(f"30 connections of unread pipelined requests: +{grown >> 20} MiB, small POSTs at most {max(seconds):.2f} s")
    assert grown < 100 << 20 and max(seconds) < 2


def test_a_read_of_pipelined_requests_is_answered_in_order(server):
    # A read of 40 requests: 16 wait at most, the rest is parsed as they are answered; all 40 are answered.
    answers = raw_exchange(server.port, request_head() * 39 + request_head("/health/ready"), answers=41, timeout=10)
    assert [status for status, _, _ in answers] == [200] * 40
    assert json.loads(answers[-1][2]) == {"status": "ready"}


def test_a_connection_closed_with_requests_pipelined_logs_no_traceback(server):
    # Two pipelined GETs, then a close: uvicorn wrote the first's answer to the closed connection, and logged a
    # 5 KB traceback for it (200 connections: 1 MB of log in 2 s).
    logged = server.log.stat().st_size
    for _ in range(100):
        with socket.create_connection(("127.0.0.1", server.port)) as sock:
            sock.sendall(request_head("/info") + request_head("/info"))
    time.sleep(1)
    with server.log.open("rb") as log:
        log.seek(logged)
        added = log.read()
    assert b"Traceback" not in added and len(added) < 10_000, added[:2000]
