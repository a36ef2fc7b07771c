"""Body bombs: bodies that cost the server far more than their bytes: punctuation that Moses splits into millions
of tokens, a million wrong items, bodies that parsed for seconds on the event loop, texts that made Moses slow, and
texts over the queue however they are cut."""

from __future__ import annotations

import socket
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import numpy as np
import orjson

from bench.common import start_server
from bench.hostile.parts import BOMB, JSON, Liveness, PeakRss, Row, memory, on_server, post_bytes

EIGHT_MB = 8 << 20


def _filled(head: bytes, item: bytes, tail: bytes, size: int = EIGHT_MB - 64) -> bytes:
    return head + item * ((size - len(head) - len(tail)) // len(item)) + item.rstrip(b",") + tail


PARSE_BODIES = {
    "empty lists": ("/embed", lambda: _filled(b'{"sentences": [', b"[],", b"]}")),
    "one-token sentences": ("/embed", lambda: _filled(b'{"sentences": [', b'["a"],', b"]}")),
    "weights": ("/embed", lambda: _filled(b'{"sentences": [["a"]], "weights": [', b"0.5,", b"]}")),
    "/tokenize": ("/tokenize", lambda: _filled(b'{"sentences": [', b'["a"],', b"]}")),
    "/v1 input": ("/v1/embeddings", lambda: _filled(b'{"input": [', b'"a",', b"]}")),
}


def punctuation_bombs(url: str, pid: int) -> None:
    times = []
    with httpx.Client(base_url=url, timeout=120) as client:
        for _ in range(5):
            start = time.monotonic()
            status = client.post("/embed", content=BOMB, headers=JSON).status_code
            times.append(time.monotonic() - start)
            assert 400 <= status < 500, status
    print(f"punctuation bomb ('a,' * 4000000, 8 MB): its {status} in {np.median(times):.3f} s median, "
          f"{max(times):.3f} s at most, of 5 (goal: < 0.2 s)")  # fmt: skip
    before = memory(pid, "VmHWM")

    def one(_):
        return httpx.post(f"{url}/embed", content=BOMB, headers=JSON, timeout=120).status_code

    start = time.monotonic()
    threads = [threading.Thread(target=one, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(f"eight at once: all answered in {time.monotonic() - start:.2f} s; peak RSS {before / 1e6:.0f} MB "
          f"before, {memory(pid, 'VmHWM') / 1e6:.0f} MB after (goal: < 1000 MB)")  # fmt: skip


def invalid_items(url: str, pid: int) -> None:
    bodies = {
        "integers": b'{"sentences": [[' + b"1," * 999_999 + b"1]]}",
        "nulls": b'{"sentences": [' + b"null," * 399_999 + b"null]}",
    }
    for name, body in bodies.items():
        with Liveness(url) as live, PeakRss(pid) as rss, httpx.Client(base_url=url, timeout=300) as client:
            start = time.perf_counter()
            status = client.post("/embed", content=body, headers=JSON).status_code
            seconds = time.perf_counter() - start
        print(f"{len(body) / 1e6:.0f} MB body of {name}: {status} in {seconds:.2f} s, liveness at most "
              f"{live.slowest:.2f} s meanwhile, RSS +{rss.grown_mb:.0f} MB (goal: 4xx < 0.5 s, liveness < 0.2 s, "
              f"< +100 MB)")  # fmt: skip


def abandon(port: int, body: bytes, after: float) -> None:
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(post_bytes("/embed", body))
    time.sleep(after)
    sock.close()


def slow_tokens(url: str, port: int) -> None:
    body = orjson.dumps({"sentences": ["a.a. " * 4000] * 10, "truncate": True})
    with httpx.Client(base_url=url, timeout=300) as client:
        start = time.perf_counter()
        status = client.post("/tokenize", content=body, headers=JSON).status_code
        print(f"'a.a. ' text, {len(body) / 1e3:.0f} KB, truncate, /tokenize: {status} in "
              f"{time.perf_counter() - start:.2f} s (goal: < 2 s)")  # fmt: skip
        sixty = orjson.dumps({"sentences": ["a.a. " * 1200] * 10, "truncate": True})
        threads = [threading.Thread(target=abandon, args=(port, sixty, 0.3)) for _ in range(6)]
        for t in threads:
            t.start()
        time.sleep(0.35)
        start = time.perf_counter()
        status = client.post("/embed", content=orjson.dumps({"sentences": ["a b"]}), headers=JSON).status_code
        small = time.perf_counter() - start
        for t in threads:
            t.join()
    print(f"   six {len(sixty) / 1e3:.0f} KB requests of it on /embed, abandoned after 0.3 s: a small request then "
          f"answered {status} in {small:.2f} s (goal: < 1 s)")  # fmt: skip


def parse_on_loop(model: Path, tree: Path) -> str:
    server, url, _ = start_server(model, root=tree)
    figures = []
    try:
        with httpx.Client(base_url=url, timeout=120) as client:
            for name, (path, make) in PARSE_BODIES.items():
                body = make()
                with PeakRss(server.pid) as rss, Liveness(url) as live:
                    time.sleep(0.1)
                    start = time.perf_counter()
                    status = client.post(path, content=body, headers=JSON).status_code
                    took = time.perf_counter() - start
                    time.sleep(0.1)
                figures.append(
                    f"{name} ({len(body) / 1e6:.1f} MB) {status} in {took:.2f} s, liveness max "
                    f"{live.slowest * 1e3:.0f} ms, RSS +{rss.grown_mb:.0f} MB"
                )
    finally:
        server.terminate()
        server.wait(timeout=60)
    return "; ".join(figures)


def hopeless_tokenize(model: Path, tree: Path) -> None:
    """100 texts of 16,000 words each with truncate: over the queue however they are cut."""
    server, url, _ = start_server(model, root=tree)
    try:
        body = orjson.dumps({"sentences": [" ".join(["word"] * 16000)] * 100, "truncate": True})
        times, statuses = [], Counter()
        with httpx.Client(base_url=url, timeout=120) as client:
            for _ in range(5):
                start = time.perf_counter()
                statuses[client.post("/tokenize", content=body, headers=JSON).status_code] += 1
                times.append(time.perf_counter() - start)
        print(
            f"/tokenize, 100 texts of 16,000 words with truncate ({len(body) / 1e6:.0f} MB): {dict(statuses)} "
            f"in {np.median(times):.2f} s median, {max(times):.2f} s at most, of 5 (goal: refused within 0.5 s)"
        )
    finally:
        server.terminate()
        server.wait(timeout=60)


ROWS: dict[str, Row] = {
    "punctuation-bombs": ("'a,' * 4,000,000, alone and eight at once", on_server(
        lambda s: punctuation_bombs(s.url, s.pid))),
    "wrong-items": ("2 MB bodies of a million integers, and of nulls", on_server(
        lambda s: invalid_items(s.url, s.pid))),
    "slow-tokens": ("texts that made Moses slow, and their clients leaving", on_server(
        lambda s: slow_tokens(s.url, s.port))),
    "parse": ("8 MB bodies that parsed for seconds on the event loop", parse_on_loop),
    "hopeless-tokenize": ("/tokenize with texts over the queue however they are cut", hopeless_tokenize),
}  # fmt: skip
