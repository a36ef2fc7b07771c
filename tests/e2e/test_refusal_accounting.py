"""How refusals are counted and answered, against real elmo-serve processes on 127.0.0.1: a client that leaves
mid-body is a 499 (its partial body was parsed and counted 422), and a sentence that cannot be allocated alone is
refused 413 naming the limit, once per request and without a traceback (it was 503 "retry", which it never would,
with a traceback each time)."""

from __future__ import annotations

import json
import resource
import socket
import time
from pathlib import Path

import httpx
import pytest

from tests.live_server import counter, free_port, launch, refusal, running_server, stop, wait_ready


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    with running_server(tiny_model_dir, tmp_path_factory.mktemp("accounting")) as s:
        yield s


def _statuses(client: httpx.Client) -> dict[str, float]:
    return {status: counter(client, "elmo_requests_total", status=status) for status in ("422", "499", "400")}


@pytest.mark.parametrize("path", ["/embed", "/v1/embeddings"])
def test_a_client_that_leaves_mid_body_is_counted_499(server, path):
    body = json.dumps({"sentences" if path == "/embed" else "input": ["a b c"] * 200}).encode()
    with httpx.Client(base_url=server.url, timeout=30) as client:
        before = _statuses(client)
        for _ in range(20):
            with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
                head = (f"POST {path} HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
                        f"content-length: {len(body)}\r\n\r\n")  # fmt: skip
                sock.sendall(head.encode() + body[: len(body) // 2])
                time.sleep(0.02)
        deadline = time.monotonic() + 10
        while (after := _statuses(client))["499"] < before["499"] + 20 and time.monotonic() < deadline:
            time.sleep(0.1)
    assert after["499"] - before["499"] == 20  # was 0, and 422 +20
    assert after["422"] == before["422"] and after["400"] == before["400"]
    assert "Traceback" not in server.log.read_text()


def _vm_size(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize")


def _batches(client: httpx.Client) -> float:
    return counter(client, "elmo_batch_sentences_count")


def test_a_sentence_that_cannot_be_allocated_alone_is_refused_413_naming_the_limit(tiny_model_dir, tmp_path):
    port, log = free_port(), tmp_path / "server.log"
    proc = launch(tiny_model_dir, log, {"ELMO_MAX_TOKENS_PER_SENTENCE": "70000"}, port)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(proc, url, log)
        small = {"sentences": [["a", "b"]], "pooling": "mean"}
        huge = {"sentences": [["word"] * 65000], "pooling": "mean"}  # about 820 MB more address space to run
        with httpx.Client(base_url=url, timeout=120) as client:
            assert client.post("/embed", json=small).status_code == 200
            # a memory limit: the address space it has now and 200 MB more (as a container's limit would be), so
            # that the sentence fails in ONNX Runtime's first run of it. With more room (300 MB, since the new graphs
            # need less) the run got far enough that the retry's allocations failed in code that
            # aborts instead of raising (OpenBLAS's buffers, glibc's thread-local data, C++ that cannot throw),
            # which no server can turn into an answer
            limit = _vm_size(proc.pid) + (200 << 20)
            resource.prlimit(proc.pid, resource.RLIMIT_AS, (limit, resource.RLIM_INFINITY))
            refused = client.post("/embed", json=huge)
            # ONNX Runtime's arena keeps what it took: the limit is lifted, as other work ending would free memory
            resource.prlimit(proc.pid, resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
            assert refused.status_code == 413, refused.text  # was 503 "inference failed (Fail); retry"
            assert "retry-after" not in refused.headers
            message = refusal(refused)
            assert message.startswith(
                "sentences: 65002 tokens with the 2 boundary tokens; this server cannot "
                "allocate the memory for a sentence of 65002 tokens or more, even alone"
            )
            assert "the limit is 65001 here" in message and "ELMO_MAX_TOKENS_PER_SENTENCE" in message
            batches = _batches(client)
            again = client.post("/embed", json=huge)  # refused before the queue: the engine does not try again
            assert again.status_code == 413 and refusal(again).startswith("sentences[0]: 65002 tokens")
            assert _batches(client) == batches
            assert client.post("/embed", json={"sentences": [["word"] * 600], "pooling": "mean"}).status_code == 200
            assert client.post("/embed", json=small).status_code == 200  # and it serves on
            assert counter(client, "elmo_requests_total", status="413") == 2
            assert counter(client, "elmo_requests_total", status="503") == 0
    finally:
        stop(proc)
    text = log.read_text()
    assert "Traceback" not in text, text[-3000:]  # was one per request
    assert text.count("failed alone for memory") == 1  # one line, for the one attempt
