"""Large bodies against a real elmo-serve on 127.0.0.1: 8 MB bodies whose items parsed for seconds on the event
loop before the count refused them are refused without holding it, a large valid body parsed off the loop is served
as before, and a large invalid one answered as FastAPI answers it. `python -m bench.hostile --rows parse` prints the
figures before and after."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from tests.live_server import refusal, rss_bytes, running_server, status_on

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
    with running_server(tiny_model_dir, tmp_path_factory.mktemp("large-bodies")) as s:  # the default limits
        yield s


# 8 MB bodies whose items parsed for seconds on the event loop before the count refused them.
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
