"""The metrics port (ELMO_METRICS_PORT) on a real elmo-serve, over real sockets: served by the main port's bounded
protocol (a head must come within the head timeout, headers over the byte limit are refused 431, connections are
capped per address), /metrics alone, without keys, rendered at most once a second however many scrape, and still
answering during the drain. It was prometheus_client's thread-per-connection server: no timeouts, 100 header
lines of 64 KB held per connection, no caps."""

from __future__ import annotations

import json
import signal
import socket
import threading
import time

import httpx
import pytest

from tests.live_server import SlowBody, free_port, launch, rss_bytes, running_server, stop, wait_ready

KEY = "k3y-metrics-port-0123"
HEAD_TIMEOUT_S = 1.0


def settings(metrics_port: int) -> dict[str, str]:
    return {"ELMO_METRICS_PORT": str(metrics_port), "ELMO_API_KEYS": KEY, "ELMO_HEAD_TIMEOUT_S": str(HEAD_TIMEOUT_S)}


@pytest.fixture(scope="module")
def metrics_port():
    return free_port()


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory, metrics_port):
    with running_server(tiny_model_dir, tmp_path_factory.mktemp("metrics-port"), settings(metrics_port)) as s:
        yield s


def scrape(port: int, path: str = "/metrics", **kwargs) -> httpx.Response:
    return httpx.get(f"http://127.0.0.1:{port}{path}", timeout=10, **kwargs)


def test_metrics_alone_without_a_key(server, metrics_port):
    scraped = scrape(metrics_port)
    assert scraped.status_code == 200 and "elmo_requests_total" in scraped.text
    assert scraped.headers["content-type"].startswith("text/plain")
    assert 'elmo_queue_tokens{model="' in scraped.text  # the gauges a scrape sets, set here too
    assert scrape(metrics_port, "/health/live").status_code == 404  # nothing but /metrics on this port
    assert scrape(metrics_port, "/metrics/x").status_code == 404
    assert httpx.post(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).status_code == 405
    head = httpx.head(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10)  # HEAD wherever GET is, no body
    assert head.status_code == 200 and int(head.headers["content-length"]) > 0 and head.content == b""
    missing = httpx.head(f"http://127.0.0.1:{metrics_port}/health/live", timeout=10)
    assert missing.status_code == 404 and missing.content == b""
    assert httpx.get(f"{server.url}/metrics", timeout=10).status_code == 401  # the main port's stays behind the keys
    # what Prometheus asks for: OpenMetrics, gzipped
    raw = httpx.get(
        f"http://127.0.0.1:{metrics_port}/metrics",
        headers={"accept": "application/openmetrics-text; version=1.0.0", "accept-encoding": "gzip"},
        timeout=10,
    )
    assert raw.headers["content-type"].startswith("application/openmetrics-text")
    assert raw.headers["content-encoding"] == "gzip" and raw.text.rstrip().endswith("# EOF")
    # an Accept header prometheus_client cannot read (an OpenMetrics version that is not numbers): the text
    # format, not a 500 and a traceback a scrape
    odd = scrape(metrics_port, headers={"accept": "application/openmetrics-text; version=abc"})
    assert odd.status_code == 200 and odd.headers["content-type"].startswith("text/plain")


def _raw(port: int, data: bytes, source: str = "127.0.0.1") -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10, source_address=(source, 0))
    if data:
        sock.sendall(data)
    return sock


def _closed_within(sock: socket.socket, seconds: float) -> tuple[bool, bytes]:
    """Whether the server closed the connection within `seconds`, and what it answered first."""
    sock.settimeout(0.2)
    got, deadline = b"", time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            part = sock.recv(65536)
        except TimeoutError:
            continue
        except OSError:  # reset
            return True, got
        if not part:
            return True, got
        got += part
    return False, got


def test_a_head_that_never_ends_is_closed_by_the_head_timeout(server, metrics_port):
    socks = [_raw(metrics_port, b"GET /metrics HTTP/1.1\r\nhost: x\r\n", f"127.0.1.{k}") for k in range(6)]
    socks += [_raw(metrics_port, b"", f"127.0.2.{k}") for k in range(6)]  # connected, never sending
    try:
        results = [_closed_within(sock, HEAD_TIMEOUT_S + 3) for sock in socks]
    finally:
        for sock in socks:
            sock.close()
    assert all(closed for closed, _ in results), results
    assert all(b" 408 " in answer for _, answer in results[:6]), results[:6]  # the head in progress is told why


def test_headers_over_the_byte_limit_are_refused_431(server, metrics_port):
    # four lines of 60 KB: under prometheus_client's (http.server's) 64 KB a line and 100 lines, over 16 KB in all
    line = b"x-filler: " + b"a" * 60_000 + b"\r\n"
    sock = _raw(metrics_port, b"")
    try:
        sock.sendall(b"GET /metrics HTTP/1.1\r\nhost: x\r\n" + line * 4 + b"\r\n")  # read and dropped after the 431
        closed, answer = _closed_within(sock, 5)
    finally:
        sock.close()
    assert answer.startswith(b"HTTP/1.1 431 ") and closed, answer[:200]


def test_connections_are_capped_per_address_and_rss_stays_bounded(server, metrics_port):
    before = rss_bytes(server.pid)
    # 40 connections from one address, each sending a head of 15 KB and then nothing: at most 8 are held
    head = b"GET /metrics HTTP/1.1\r\nhost: x\r\n" + (b"x-filler: " + b"a" * 1000 + b"\r\n") * 15
    socks = [_raw(metrics_port, head, "127.0.3.1") for _ in range(40)]
    try:
        time.sleep(0.3)
        refused = 0
        for sock in socks:
            sock.settimeout(0.05)
            try:
                answer = sock.recv(4096)
            except TimeoutError:
                continue
            refused += answer.startswith(b"HTTP/1.1 503 ")
        grown = rss_bytes(server.pid) - before
        assert refused == 40 - 8, refused  # service/server/metrics_port.py's MAX_PER_CLIENT
        assert scrape(metrics_port).status_code == 200  # another address is still served meanwhile
    finally:
        for sock in socks:
            sock.close()
    assert grown < 30e6, grown


def test_concurrent_scrapes_share_one_render_a_second(server, metrics_port):
    bodies: list[str] = []
    stop_at = time.monotonic() + 2.5

    def scraper():
        with httpx.Client(timeout=10) as client:
            while time.monotonic() < stop_at:
                bodies.append(client.get(f"http://127.0.0.1:{metrics_port}/metrics").text)

    def changer():  # each main-port request changes elmo_requests_total: a new render would show it
        with httpx.Client(timeout=10) as client:
            while time.monotonic() < stop_at:
                client.get(f"{server.url}/health/ready")
                time.sleep(0.02)

    threads = [threading.Thread(target=scraper) for _ in range(8)] + [threading.Thread(target=changer)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    renders = len(set(bodies))
    assert 2 <= renders <= 4, renders  # one a second (2.5 s), however many scraped
    assert len(bodies) <= 10 * (2.5 + 0.8) + 4, len(bodies)  # paced: 10 a second (the last slots up to 0.8 s after)


def test_the_metrics_port_answers_during_the_drain(tiny_model_dir, tmp_path):
    port, metrics_port, log = free_port(), free_port(), tmp_path / "server.log"
    proc = launch(tiny_model_dir, log, settings(metrics_port) | {"ELMO_DRAIN_S": "20"}, port)
    try:
        wait_ready(proc, f"http://127.0.0.1:{port}", log)
        body = json.dumps({"sentences": [["slow", "body"]]}).encode()
        slow = SlowBody(port, "GET", "/health/ready", body)  # in flight until finished: the drain waits for it
        time.sleep(0.3)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        assert proc.poll() is None
        scraped = scrape(metrics_port)
        assert scraped.status_code == 200 and "elmo_requests_total" in scraped.text, log.read_text()
        status, _, _ = slow.finish()
        assert status == 503  # readiness says draining
        assert proc.wait(timeout=20) == 0, log.read_text()
        with pytest.raises(httpx.TransportError):  # closed once the process is done
            scrape(metrics_port)
    finally:
        stop(proc)


def test_the_metrics_port_answers_while_the_models_load(tiny_model_dir, tmp_path):
    port, metrics_port, log = free_port(), free_port(), tmp_path / "server.log"
    proc = launch(tiny_model_dir, log, settings(metrics_port), port)
    scraped_before_listening = 0
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                scraped = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10)
            except httpx.TransportError:
                time.sleep(0.005)
                continue
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break  # the main port listens: the models are loaded
            except ConnectionRefusedError:  # scraped while the models load
                scraped_before_listening += scraped.status_code == 200
        wait_ready(proc, f"http://127.0.0.1:{port}", log)
    finally:
        stop(proc)
    assert scraped_before_listening >= 1, log.read_text()
