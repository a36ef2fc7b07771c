"""The fifth round of hardening (issue 39), each against a real elmo-serve on 127.0.0.1: bodies that parsed for
seconds on the event loop, settings that should be refused, forged log lines, tokenizing shared by address,
traces. bench/hostile_fifth.py prints the figures before and after."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from tests.live_server import (
    counter,
    free_port,
    launch,
    raw_exchange,
    refusal,
    rss_bytes,
    running_server,
    status_on,
    stop,
)

JSON = {"content-type": "application/json"}
EIGHT_MB = (8 << 20) - 64


def filled(head: bytes, item: bytes, tail: bytes) -> bytes:
    return head + item * ((EIGHT_MB - len(head) - len(tail)) // len(item)) + item.rstrip(b",") + tail


class Liveness:
    """/health/live every 10 ms on a thread of its own: the slowest answer while running."""

    def __init__(self, url: str):
        self.url, self.stop, self.times = url, threading.Event(), []
        self.thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        with httpx.Client(base_url=self.url, timeout=60) as client:
            while not self.stop.is_set():
                start = time.perf_counter()
                client.get("/health/live")
                self.times.append(time.perf_counter() - start)
                time.sleep(0.01)

    def __enter__(self) -> Liveness:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.times and time.monotonic() < deadline:  # polling already (a loaded host starts slowly)
            time.sleep(0.01)
        return self

    def __exit__(self, *_) -> None:
        self.stop.set()
        self.thread.join()


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    with running_server(tiny_model_dir, tmp_path_factory.mktemp("fifth")) as s:  # the default limits
        yield s


# Item 1: 8 MB bodies whose items parsed for seconds on the event loop before the count refused them.
PARSED = [
    ("empty-lists", "/embed", filled(b'{"sentences": [', b"[],", b"]}"), 413, "sentences"),
    ("one-token-sentences", "/embed", filled(b'{"sentences": [', b'["a"],', b"]}"), 413, "sentences"),
    ("weights", "/embed", filled(b'{"sentences": [["a"]], "weights": [', b"0.5,", b"]}"), 422, "weights"),
    ("tokenize", "/tokenize", filled(b'{"sentences": [', b'["a"],', b"]}"), 413, "sentences"),
    ("openai-input", "/v1/embeddings", filled(b'{"input": [', b'"a",', b"]}"), 413, "input"),
]


@pytest.mark.parametrize("route, body, status, field", [c[1:] for c in PARSED], ids=[c[0] for c in PARSED])
def test_a_large_body_is_refused_without_holding_the_event_loop(server, client, route, body, status, field):
    rss = rss_bytes(server.pid)
    with Liveness(server.url) as live:
        time.sleep(0.05)
        start = time.perf_counter()
        response = client.post(route, content=body, headers=JSON)
        took = time.perf_counter() - start
        time.sleep(0.05)
    assert response.status_code == status_on(route, status), response.text[:300]
    assert refusal(response).startswith(field)
    # Before: 2.6 s of the loop for the empty lists (liveness waited as long) and +300 MB; here liveness stays
    # within a loaded 2-core host's noise, and the server builds at most a window's worth of the items.
    assert max(live.times) < 0.5, (max(live.times), took)
    assert rss_bytes(server.pid) - rss < 100e6


def test_a_large_valid_body_parsed_off_the_loop_is_served_as_before(server, client):
    """64 sentences of 1,000 tokens (a third of a MB, over the inline size): served, each echoed as sent."""
    sentences = [[f"w{k % 7}" for k in range(1000)] for _ in range(64)]
    body = httpx.Request("POST", "/", json={"sentences": sentences, "truncate": True}).content
    response = client.post("/tokenize", content=body, headers=JSON)
    assert response.status_code == 200, response.text[:300]
    data = response.json()["data"]
    assert [item["tokens"] for item in data] == sentences


@pytest.mark.parametrize(
    "body, field",
    [
        (b'{"sentences": [["a"], ["b", 1]], "pad": "' + b"x" * 40_000 + b'"}', "sentences.1"),
        (b'{"sentences": [' + b'["' + b"a" * 60 + b'"],' * 400 + b'["a"] ', "body"),  # cut short: invalid JSON
        (b'{"sentences": [["a"]], "layers": [' + b"0," * 30_000 + b"0]}", "layers"),
        (b'{"sentences": [["a"]], "mixes": [' + b"{}," * 30_000 + b"{}]}", "mixes"),
    ],
    ids=["wrong-token", "cut-short", "30k-layers", "30k-mixes"],
)
def test_a_large_invalid_body_is_answered_as_fastapi_answers_it(client, body, field):
    response = client.post("/embed", content=body, headers=JSON)
    assert response.status_code == 422, response.text[:300]
    assert refusal(response).startswith(field)


# Item 11: settings refused before the model loads, with one line naming the variable.
REFUSED = {
    "forwarded-every-ipv4": ({"ELMO_FORWARDED_ALLOW_IPS": "10.0.0.1,0.0.0.0/0"}, "ELMO_FORWARDED_ALLOW_IPS="),
    "forwarded-every-ipv6": ({"ELMO_FORWARDED_ALLOW_IPS": "::/0"}, "ELMO_FORWARDED_ALLOW_IPS="),
    "keys-only-commas": ({"ELMO_API_KEYS": ",,,"}, "ELMO_API_KEYS=',,,': holds no key"),
    "keys-only-spaces": ({"ELMO_API_KEYS": " , "}, "ELMO_API_KEYS=' , ': holds no key"),
    "metrics-port-is-the-port": ({"ELMO_METRICS_PORT": "{port}"}, "ELMO_METRICS_PORT ({port}) is ELMO_PORT"),
}


@pytest.mark.parametrize("case", REFUSED, ids=list(REFUSED))
def test_a_setting_that_would_open_or_break_the_server_is_refused_before_loading(tiny_model_dir, tmp_path, case):
    settings, line = REFUSED[case]
    port = free_port()
    settings = {name: value.format(port=port) for name, value in settings.items()}
    log = tmp_path / "server.log"
    start = time.perf_counter()
    proc = launch(tiny_model_dir, log, settings, port)
    try:
        assert proc.wait(timeout=60) == 1, log.read_text()
    finally:
        stop(proc)  # one that started (before the fix) is stopped
    text = log.read_text()
    assert len(text.splitlines()) == 1 and text.startswith(f"elmo-serve: {line.format(port=port)}"), text
    assert "serving" not in text and time.perf_counter() - start < 30  # the model never loaded


@pytest.mark.parametrize("tag", ['W/"{etag}"', "*", '"other", W/"{etag}"'])
def test_if_none_match_with_a_weak_etag_or_a_star_is_304(client, tag):
    etag = client.get("/openapi.json").headers["etag"]
    given = tag.format(etag=etag.strip('"'))
    response = client.get("/openapi.json", headers={"if-none-match": given})
    assert response.status_code == 304, (given, response.status_code)
    assert response.content == b"" and response.headers["etag"] == etag


# Item 5: no raw control character in a text log line, whatever the client sends.
FORGED = b"/x%0D%0A2026-11-28 12:00:00,000 INFO elmo.access: GET /embed status=200%1B[2K%1B[1A%C2%85"


def test_an_unmatched_path_never_reaches_the_text_log_raw(tiny_model_dir, tmp_path):
    settings = {"ELMO_ACCESS_LOG": "true", "ELMO_LOG_FORMAT": "text"}
    with running_server(tiny_model_dir, tmp_path, settings) as server:
        head = b"GET " + FORGED.replace(b" ", b"%20") + b" HTTP/1.1\r\nhost: [::1]\r\nx-request-id: forged-1\r\n\r\n"
        ((status, _, _),) = raw_exchange(server.port, head, 1)
        assert status == 404
        post = b"POST /embed%0D%0Ax HTTP/1.1\r\nhost: [::1]\r\ncontent-length: 2\r\nx-request-id: forged-2\r\n\r\n{}"
        ((status, _, _),) = raw_exchange(server.port, post, 1)
        assert status in (404, 405)
        time.sleep(0.5)
        log = server.log.read_bytes()
    lines = [line for line in log.split(b"\n") if b"forged-" in line]
    assert len(lines) == 2, log[-2000:]
    assert lines[0].endswith(b"elmo.access: GET other status=404 " + lines[0].split(b"status=404 ")[1])
    assert b"route=" not in lines[0] and b"2026-11-28 12:00:00" not in log  # the path is not logged at all
    for raw in (b"\r", b"\x1b", b"\x85", "\u2028".encode()):
        assert raw not in log, raw


# Item 6: tokenizing in turns by address, bounded per address; truncate tokenizes what it keeps.
LONG_TEXT = " ".join(["x" * 199] * 1000)  # 200,000 characters, 1,000 tokens: Moses reads every character


def test_one_address_s_long_texts_do_not_starve_another_s_tokenizing(tiny_model_dir, tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    settings = {"ELMO_TOKENIZE_THREADS": "1"}
    body = httpx.Request("POST", "/", json={"sentences": [LONG_TEXT] * 8}).content
    small = {"sentences": ["She went to the bank."]}
    with running_server(tiny_model_dir, tmp_path, settings) as server:
        stop = threading.Event()

        def attacker(_):
            transport = httpx.HTTPTransport(local_address="127.0.0.2")
            with httpx.Client(base_url=server.url, transport=transport, timeout=120) as c:
                while not stop.is_set():
                    assert c.post("/tokenize", content=body, headers=JSON).status_code in (200, 503)

        times = []
        with ThreadPoolExecutor(4) as pool:
            attacks = [pool.submit(attacker, k) for k in range(4)]
            time.sleep(1.0)  # every attacker's texts in line
            transport = httpx.HTTPTransport(local_address="127.0.0.3")
            with httpx.Client(base_url=server.url, transport=transport, timeout=120) as c:
                for _ in range(12):
                    start = time.perf_counter()
                    assert c.post("/tokenize", json=small).status_code == 200
                    times.append(time.perf_counter() - start)
                    time.sleep(0.1)
            stop.set()
            for attack in attacks:
                attack.result()
    times.sort()
    # Before: first in, first out behind up to 32 texts of 200,000 characters (seconds); in turns, behind one.
    assert times[len(times) // 2] < 0.5 and times[-1] < 1.0, times


def test_an_address_s_characters_in_tokenizing_are_bounded(tiny_model_dir, tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    settings = {"ELMO_TOKENIZE_THREADS": "1", "ELMO_MAX_TOKENIZE_CHARS_PER_CLIENT": "1000000"}
    text = " ".join(["x" * 899] * 1000)  # 900,000 characters: one request is always taken, two are not
    with running_server(tiny_model_dir, tmp_path, settings) as server:
        with ThreadPoolExecutor(3) as pool:
            posts = [
                pool.submit(httpx.post, f"{server.url}/tokenize", json={"sentences": [text]}, timeout=120)
                for _ in range(3)
            ]
            statuses = sorted(p.result().status_code for p in posts)
            refused = next(p.result() for p in posts if p.result().status_code == 503)
        assert statuses[0] == 200 and 503 in statuses, statuses
        assert "texts being tokenized for your address hold" in refusal(refused)
        assert refused.headers["retry-after"] == "1"


def test_truncate_tokenizes_only_what_it_keeps_and_keeps_the_same_tokens(server, client):
    from service.text.moses import tokenize

    # Non-breaking prefixes and full stops around the cut, which Moses reads with the next word
    words = ("Dr. Smith went to the U.S. in 1999 , e.g. to see Mr. Jones . " * 600).split()
    texts = [" ".join(words[k:]) for k in range(20)]  # 20 texts of 8,400 words (13,800 by the upper bound)
    before = counter(client, "elmo_stage_seconds_sum", stage="tokenize")
    response = client.post("/tokenize", json={"sentences": texts, "truncate": True})
    moses_cpu = counter(client, "elmo_stage_seconds_sum", stage="tokenize") - before
    assert response.status_code == 200, response.text[:300]
    start = time.thread_time()
    tokenize(texts[0])
    whole_cpu = time.thread_time() - start
    for text, item in zip(texts, response.json()["data"], strict=True):
        assert item["tokens"] == tokenize(text)[:1000]  # what the whole text's tokenizing keeps
        assert item["truncated"] is True and item["original_tokens_at_least"] is True
        assert item["original_tokens"] == len(text.split())  # its words: no more than its tokens
    # Before: Moses read all 168,000 words (20 whole texts' CPU); now 20 x 1,016 of them (an eighth of that).
    assert moses_cpu < 0.4 * 20 * whole_cpu, (moses_cpu, whole_cpu)


# Item 7: traces carry no request text or secrets, no span for a refused request, trace context only from trusted
# proxies, and an exit bounded when the collector never answers.
class Collector:
    """A stand-in OTLP/HTTP collector on 127.0.0.1: every span it is sent."""

    def __init__(self):
        import http.server

        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

        spans = self.spans = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):  # http.server's name
                export = ExportTraceServiceRequest()
                export.ParseFromString(self.rfile.read(int(self.headers["content-length"])))
                spans.extend(s for r in export.resource_spans for scope in r.scope_spans for s in scope.spans)
                self.send_response(200)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"

    def wait_for(self, name: str) -> None:
        deadline = time.monotonic() + 15
        while not any(s.name == name for s in self.spans) and time.monotonic() < deadline:
            time.sleep(0.05)


def attributes(span) -> dict:
    return {a.key: a.value.string_value or a.value.int_value for a in span.attributes}


def test_spans_carry_no_query_values_nor_long_paths_and_none_for_a_refused_request(tiny_model_dir, tmp_path):
    collector = Collector()
    key, trace_id = "k-5", "4bf92f3577b34da6a3ce929d0e0e4736"
    settings = {"OTEL_EXPORTER_OTLP_ENDPOINT": collector.endpoint, "OTEL_METRICS_EXPORTER": "none",
                "OTEL_BSP_SCHEDULE_DELAY": "50", "ELMO_API_KEYS": key}  # fmt: skip
    auth, parent = {"authorization": f"Bearer {key}"}, {"traceparent": f"00-{trace_id}-00f067aa0ba902b7-01"}
    try:
        with running_server(tiny_model_dir, tmp_path, settings) as server, httpx.Client(timeout=30) as c:
            long = f"{server.url}/x{'a' * 4_000}?text=Zanzibar&api_key=sk-live-123"
            assert c.get(long, headers=auth).status_code == 404
            refused = c.post(f"{server.url}/embed?refused=1", json={"sentences": ["A text ."]}, headers=parent)
            assert refused.status_code == 401
            answer = c.post(f"{server.url}/embed", json={"sentences": ["A text ."]}, headers={**auth, **parent})
            assert answer.status_code == 200
            collector.wait_for("elmo.encode")
    finally:
        collector.server.shutdown()
    servers = [attributes(s) for s in collector.spans if "url.path" in attributes(s)]
    assert len(servers) == 2, servers  # the 404 and the 200: none for the 401
    (unmatched,) = [a for a in servers if a["url.path"].startswith("/x")]
    assert len(unmatched["url.path"]) <= 103 and unmatched["url.query"] == "text=REDACTED&api_key=REDACTED"
    assert not [a for a in servers if "refused" in str(a.get("url.query"))]
    # From 127.0.0.1, not a trusted proxy here: the caller's traceparent is not followed
    assert not [s for s in collector.spans if s.trace_id.hex() == trace_id]


def test_traceparent_is_followed_from_a_trusted_proxy_only(tiny_model_dir, tmp_path):
    collector = Collector()
    trace_id = "0af7651916cd43dd8448eb211c80319c"
    settings = {"OTEL_EXPORTER_OTLP_ENDPOINT": collector.endpoint, "OTEL_METRICS_EXPORTER": "none",
                "OTEL_BSP_SCHEDULE_DELAY": "50", "ELMO_FORWARDED_ALLOW_IPS": "127.0.0.1"}  # fmt: skip
    parent = {"traceparent": f"00-{trace_id}-b7ad6b7169203331-01"}
    try:
        with running_server(tiny_model_dir, tmp_path, settings) as server:
            other = httpx.HTTPTransport(local_address="127.0.0.2")
            with httpx.Client(transport=other, timeout=30) as c:  # not a proxy: its trace context is dropped
                assert c.post(f"{server.url}/tokenize", json={"sentences": ["a"]}, headers=parent).status_code == 200
            with httpx.Client(timeout=30) as c:  # the trusted proxy's is followed
                assert c.post(f"{server.url}/embed", json={"sentences": ["a"]}, headers=parent).status_code == 200
            collector.wait_for("elmo.encode")
    finally:
        collector.server.shutdown()
    followed = {s.name for s in collector.spans if s.trace_id.hex() == trace_id}
    assert "POST /embed" in followed and "POST /tokenize" not in followed, followed


def test_the_exit_is_bounded_when_the_collector_never_answers(tiny_model_dir, tmp_path):
    import signal
    import socket

    hole = socket.socket()  # accepts connections (the kernel's backlog) and never answers
    hole.bind(("127.0.0.1", 0))
    hole.listen(64)
    settings = {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{hole.getsockname()[1]}",
                "OTEL_METRICS_EXPORTER": "none", "OTEL_BSP_SCHEDULE_DELAY": "50"}  # fmt: skip
    try:
        with running_server(tiny_model_dir, tmp_path, settings) as server, httpx.Client(timeout=30) as c:
            for _ in range(20):
                assert c.post(f"{server.url}/embed", json={"sentences": ["A text ."]}).status_code == 200
            time.sleep(0.5)
            start = time.perf_counter()
            server.proc.send_signal(signal.SIGTERM)
            server.proc.wait(timeout=120)
            took = time.perf_counter() - start
    finally:
        hole.close()
    from service.api.tracing import EXIT_EXPORT_S

    # Before: 41.9 s (four exports of 10 s each) with nothing in flight; the grace arithmetic counts EXIT_EXPORT_S.
    assert took < EXIT_EXPORT_S + 5, took
