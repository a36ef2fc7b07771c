"""Stopping a real elmo-serve with SIGTERM while it is busy: it stops accepting connections, /health/ready turns
503, every request in flight is answered with the right numbers, and the process exits 0 within the drain bound."""

from __future__ import annotations

import base64
import itertools
import json
import signal
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest

from tests.live_server import SlowBody, counter, free_port, launch, wait_ready

DRAIN_S = 20
LONG = 1000  # tokens per sentence of the slow requests: each is a batch of its own (ELMO_BATCH_TOKENS)
SETTINGS = {"ELMO_BATCH_TOKENS": str(LONG + 2), "ELMO_DRAIN_S": str(DRAIN_S)}


def refused(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except ConnectionRefusedError:
        return True
    return False


def layers(item: dict) -> np.ndarray:
    return np.frombuffer(base64.b64decode(item["embedding"]), "<f4").reshape(item["shape"])


def test_sigterm_while_busy_answers_everything_in_flight_then_exits_0(tiny_model_dir, tmp_path, engine, sentences):
    port, log = free_port(), tmp_path / "server.log"
    url = f"http://127.0.0.1:{port}"
    proc = launch(tiny_model_dir, log, SETTINGS, port)
    try:
        wait_ready(proc, url, log)
        words = list(itertools.chain(*sentences))
        own = [[*itertools.islice(itertools.cycle(words), k, k + LONG - 1), f"request-{k}"] for k in range(24)]
        requests = [own[k : k + 6] for k in range(0, 24, 6)]  # 4 requests of 6 sentences: 24 engine batches
        done_at: dict[int, float] = {}

        def post(k: int) -> httpx.Response:
            body = {"sentences": requests[k], "output": "layers", "encoding": "base64"}
            response = httpx.post(f"{url}/embed", json=body, timeout=120)
            done_at[k] = time.monotonic()
            return response

        slow_embed = SlowBody(port, "POST", "/embed", json.dumps({"sentences": [["slow", "body"]]}).encode())
        slow_ready = SlowBody(port, "GET", "/health/ready", b"{}")  # a body, so it is in flight until finished
        metrics = httpx.Client(base_url=url)
        before = counter(metrics, "elmo_inference_seconds_count")
        with ThreadPoolExecutor(len(requests)) as pool:
            futures = [pool.submit(post, k) for k in range(len(requests))]
            deadline = time.monotonic() + 30
            # The engine is on them and all four arrived: more sentences wait than three requests hold (one
            # sentence runs at a time with this budget), so they are all in flight.
            three_requests = 3 * 6 * (LONG + 2)  # tokens
            while counter(metrics, "elmo_inference_seconds_count") < before + 2 or (
                counter(metrics, "elmo_queue_tokens") <= three_requests
            ):
                assert time.monotonic() < deadline, "the requests never reached the engine"
                time.sleep(0.01)
            proc.send_signal(signal.SIGTERM)
            term_at = time.monotonic()

            deadline = time.monotonic() + 5
            while not refused(port):
                assert time.monotonic() < deadline, "still accepting connections 5 s after SIGTERM"
                time.sleep(0.02)
            assert proc.poll() is None  # refusing new connections, still finishing the old ones

            status, headers, body = slow_ready.finish()  # draining: not ready
            assert status == 503 and json.loads(body) == {"status": "draining"} and headers["retry-after"]
            status, _, body = slow_embed.finish()  # got in before the signal: served
            assert status == 200, body
            (item,) = json.loads(body)["data"]
            assert item["tokens"] == ["slow", "body"]
            want_mix = engine.run([["slow", "body"]])[0].mean(axis=0)  # the default mix: the mean of the layers
            np.testing.assert_allclose(np.asarray(item["embedding"]), want_mix, rtol=0, atol=1e-6)
            responses = [f.result() for f in futures]

        assert max(done_at.values()) > term_at  # some of them were still computing when the signal came
        want = engine.run(own)
        for k, response in enumerate(responses):
            assert response.status_code == 200, response.text
            data = response.json()["data"]
            assert [item["tokens"] for item in data] == requests[k]
            for item, expected in zip(data, want[6 * k : 6 * k + 6], strict=True):
                np.testing.assert_allclose(layers(item), expected, rtol=0, atol=1e-6)

        assert proc.wait(timeout=DRAIN_S + 10) == 0
        assert time.monotonic() - term_at < DRAIN_S
        text = log.read_text()
        assert "draining" in text and "Traceback" not in text
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_request_still_running_after_the_drain_bound_is_cut_with_503(tiny_model_dir, tmp_path):
    port, log = free_port(), tmp_path / "server.log"
    url = f"http://127.0.0.1:{port}"
    proc = launch(tiny_model_dir, log, {"ELMO_DRAIN_S": "1"}, port)
    try:
        wait_ready(proc, url, log)
        stalled = SlowBody(port, "POST", "/embed", json.dumps({"sentences": [["never", "sent"]]}).encode())
        time.sleep(0.2)  # its headers are in: uvicorn holds the connection open for it
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
        assert time.monotonic() - start < 1 + 5
        status, headers, body = stalled.finish()  # cut off: told to go elsewhere, not a 500
        assert status == 503 and headers["retry-after"] == "1" and b"shutting down" in body, body
        assert "Traceback" not in log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_an_answer_still_being_sent_at_the_drain_bound_ends_without_a_traceback(tiny_model_dir, tmp_path):
    # A slow reader (it reads nothing) of a 5 MB answer when the drain time ends: uvicorn cancelled its request
    # and logged a CancelledError traceback; its connection is closed instead, with a line in the log.
    port, log = free_port(), tmp_path / "server.log"
    proc = launch(tiny_model_dir, log, {"ELMO_DRAIN_S": "1"}, port)
    try:
        wait_ready(proc, f"http://127.0.0.1:{port}", log)
        body = json.dumps({"sentences": [[f"w{k % 50}" for k in range(500)]] * 9, "output": "layers"}).encode()
        sock = socket.create_connection(("127.0.0.1", port))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        head = (
            f"POST /embed HTTP/1.1\r\nhost: [::1]\r\n"
            f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
        )
        sock.sendall(head.encode() + body)
        sock.settimeout(30)
        assert sock.recv(12) == b"HTTP/1.1 200"  # its answer has started
        time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
        sock.close()
        text = log.read_text()
        assert "Traceback" not in text and "CancelledError" not in text, text[-3000:]
        assert "the drain time passed while an answer was being sent" in text
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def busy_server(tiny_model_dir, tmp_path, requests: int = 4):
    """A server computing `requests` requests of six 1,000-token sentences (one engine batch each), sent from a
    pool of threads: the process, its log, the pool and the requests' futures."""
    port, log = free_port(), tmp_path / "server.log"
    url = f"http://127.0.0.1:{port}"
    proc = launch(tiny_model_dir, log, SETTINGS, port)
    try:
        wait_ready(proc, url, log)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    sentences = [[f"w{j % 40}" for j in range(LONG - 1)] + [f"s{k}"] for k in range(6)]
    body = {"sentences": sentences, "output": "layers", "encoding": "base64"}
    pool = ThreadPoolExecutor(requests)
    futures = [pool.submit(httpx.post, f"{url}/embed", json=body, timeout=120) for _ in range(requests)]
    with httpx.Client(base_url=url) as metrics:
        deadline = time.monotonic() + 30
        while counter(metrics, "elmo_inference_seconds_count") < 1:  # the engine is on them
            assert time.monotonic() < deadline, "the requests never reached the engine"
            time.sleep(0.01)
    return proc, log, pool, futures


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_second_signal_under_load_stops_at_once_with_one_line(tiny_model_dir, tmp_path, sig):
    # The second signal ended the process with a traceback, or aborted it (exit 134, "terminate called without an
    # active exception") while ONNX Runtime was computing.
    proc, log, pool, futures = busy_server(tiny_model_dir, tmp_path)
    try:
        proc.send_signal(sig)
        time.sleep(0.3)  # draining, the requests still computing
        assert proc.poll() is None
        proc.send_signal(sig)
        start = time.monotonic()
        assert proc.wait(timeout=10) == 0
        assert time.monotonic() - start < 3
        text = log.read_text()
        assert f"a second stop signal ({sig.name}): stopping now" in text, text
        assert "Traceback" not in text and "terminate called" not in text and "CancelledError" not in text, text
        unanswered = sum(isinstance(f.exception(), httpx.TransportError) for f in futures)
        assert unanswered >= 1  # stopped without waiting for them
    finally:
        pool.shutdown(wait=True)
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_sighup_drains_like_sigterm(tiny_model_dir, tmp_path):
    # SIGHUP's default action killed the process at once: the requests in flight got empty replies, and nothing
    # was logged.
    proc, log, pool, futures = busy_server(tiny_model_dir, tmp_path, requests=2)
    try:
        proc.send_signal(signal.SIGHUP)
        responses = [f.result() for f in futures]
        assert [r.status_code for r in responses] == [200, 200]
        assert proc.wait(timeout=DRAIN_S + 10) == 0
        text = log.read_text()
        assert "draining" in text and "Traceback" not in text
    finally:
        pool.shutdown(wait=True)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
