"""Slow clients: uploads that stall or trickle to hold the body budget, readers that never read an answer of the
static files, answers sent early and a byte after them, and bodies in 1-byte chunks."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import orjson

from bench.common import start_server
from bench.hostile.parts import (
    JSON,
    SMALL,
    PeakRss,
    Probe,
    Row,
    answered,
    cpu_seconds,
    from_address,
    on_server,
    stalled_upload,
)


def stalled_uploads(port: int, url: str) -> None:
    # two from each of five addresses (one address may hold 16 MiB of the 64 MiB)
    socks = [stalled_upload(port, 7 << 20, source=f"127.0.0.{2 + k // 2}") for k in range(9)]
    socks.append(stalled_upload(port, (1 << 20) - 8, source="127.0.0.6"))
    stall = time.monotonic()
    with httpx.Client(base_url=url, timeout=30) as client:
        statuses = Counter()
        while (status := client.post("/embed", content=SMALL, headers=JSON).status_code) != 200 or not statuses:
            statuses[status] += 1
            if time.monotonic() > stall + 60:
                raise SystemExit("still refused 60 s after the stall")
            time.sleep(0.1)
    seconds = time.monotonic() - stall
    for sock in socks:
        sock.close()
    print(f"stalled uploads: a small POST answered 200 {seconds:.1f} s after the stall "
          f"(refused meanwhile: {dict(statuses)}; goal: within 15 s)")  # fmt: skip


def budget_holder(port: int, address: str, stop: threading.Event, bucket: list[float], sent: Counter) -> None:
    """One connection of the attack: 8 MiB minus a few bytes at once, then a byte every 9 s, again when cut off
    or refused; within the attacker's share of about 4 Mbit/s (`bucket`: bytes it may still send)."""
    body = 8 << 20
    while not stop.is_set():
        while bucket[0] < body - 16 and not stop.is_set():
            time.sleep(0.1)
        if stop.is_set():
            return
        bucket[0] -= body - 16
        try:
            sock = from_address(address, port)
            head = (
                f"POST /embed HTTP/1.1\r\nhost: [::1]\r\ncontent-type: application/json\r\n"
                f"content-length: {body}\r\n\r\n"
            )
            sock.sendall(head.encode() + b"x" * (body - 16))
            sent["bodies"] += 1
            sock.settimeout(9)
            while not stop.is_set():
                try:
                    if not sock.recv(4096):
                        break  # answered (408 or 503) and closed: again
                    sent["answers"] += 1
                    break
                except TimeoutError:
                    sock.sendall(b"x")
            sock.close()
        except OSError:
            pass
        stop.wait(1)  # Retry-After


def budget_at_4_mbits(url: str, port: int, seconds: float = 60) -> None:
    stop, bucket, sent = threading.Event(), [float(64 << 20)], Counter()  # it starts with what the attack sent at once

    def refill():
        while not stop.wait(0.1):
            bucket[0] = min(bucket[0] + 0.1 * 4e6 / 8, float(64 << 20))

    threads = [threading.Thread(target=refill)]
    threads += [threading.Thread(target=budget_holder, args=(port, "127.0.0.2", stop, bucket, sent)) for _ in range(8)]
    for t in threads:
        t.start()
    statuses = Counter()
    end = time.monotonic() + seconds
    with httpx.Client(base_url=url, timeout=30) as client:
        while time.monotonic() < end:
            body = orjson.dumps({"sentences": [["The", "bank", "of", "the", "river", "."] * 40] * 6})  # 1.4 KB
            statuses[client.post("/embed", content=body, headers=JSON).status_code] += 1
            time.sleep(0.25)
    stop.set()
    for t in threads:
        t.join()
    share = statuses[200] / max(1, sum(statuses.values()))
    print(f"8 connections from one other address holding the body budget at ~4 Mbit/s ({sent['bodies']} bodies "
          f"of 8 MiB sent) for {seconds:.0f} s: ordinary 1.4 KB POSTs {dict(statuses)}, {share:.1%} answered 200 "
          f"(goal: >= 95%)")  # fmt: skip


def slow_reader(port: int, address: str, request: bytes) -> socket.socket | None:
    """A connection with a 1 KB receive window that sends `request` and never reads."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)  # before connecting: the window it advertises
    try:
        sock.bind((address, 0))
        sock.connect(("127.0.0.1", port))
        sock.sendall(request)
    except OSError:
        sock.close()
        return None
    return sock


def slow_static_readers(model: Path, tree: Path, connections: int = 2000, seconds: float = 15) -> None:
    """Readers that never read the Swagger UI bundle (1.5 MB), from one address and from twenty, and
    pipelines of the OpenAPI document."""
    bundle = b"GET /static-offline-docs/swagger-ui-bundle.js HTTP/1.1\r\nhost: [::1]\r\n\r\n"
    openapi = b"GET /openapi.json HTTP/1.1\r\nhost: [::1]\r\n\r\n" * 16
    cases = [(f"{connections} readers of the 1.5 MB Swagger UI bundle from one address", bundle, ["127.0.0.2"]),
             (f"{connections} of them from 20 addresses", bundle, [f"127.0.1.{k}" for k in range(1, 21)]),
             ("500 connections of 16 pipelined GET /openapi.json, from 20 addresses", openapi,
              [f"127.0.2.{k}" for k in range(1, 21)])]  # fmt: skip
    for name, request, addresses in cases:
        count = connections if request is bundle else 500
        server, url, port = start_server(model, root=tree)
        try:
            with PeakRss(server.pid) as rss, Probe(url, "127.0.0.9", every=0.1) as live:
                time.sleep(1)
                socks = [slow_reader(port, addresses[k % len(addresses)], request) for k in range(count)]
                time.sleep(seconds)
            statuses = Counter(answered(sock) if sock else "not connected" for sock in socks)
            print(f"{name}, never reading, {seconds:.0f} s: RSS +{rss.grown_mb:.0f} MB at most; /health/live "
                  f"every 0.1 s from another address: {live.figures()}; the readers' answers {dict(statuses)} "
                  "(goal: < +300 MB, liveness < 1 s)")  # fmt: skip
            for sock in socks:
                if sock:
                    sock.close()
        finally:
            server.terminate()
            server.wait(timeout=60)


def early_answers_then_a_byte(model: Path, tree: Path, count: int = 20, silence_s: float = 30) -> str:
    """Connections answered 401 before their bodies came, then sent one more byte of the body."""
    server, _, port = start_server(model, root=tree, settings={"ELMO_API_KEYS": "bench-key"})
    try:
        head = b"POST /embed HTTP/1.1\r\nhost: [::1]\r\ncontent-type: application/json\r\ncontent-length: 1000\r\n\r\n{"
        socks, statuses = [], Counter()
        for _ in range(count):
            sock = socket.create_connection(("127.0.0.1", port), timeout=10)
            sock.sendall(head)
            statuses[sock.recv(12)[9:12].decode() or "closed"] += 1
            sock.sendall(b"x")  # one more byte of the body, after the answer
            socks.append(sock)
        time.sleep(silence_s)
        still_open = 0
        for sock in socks:
            sock.settimeout(0)
            try:
                while sock.recv(65536):
                    pass
            except BlockingIOError:
                still_open += 1  # nothing to read, and not closed
            except OSError:
                pass  # reset: closed
            sock.close()
        return f"answered {dict(statuses)}; {still_open} of {count} still open after {silence_s:.0f} s of silence"
    finally:
        server.terminate()
        server.wait(timeout=60)


def _chunked(port: int, body: bytes, size: int) -> tuple[str, float]:
    """`body` sent chunked, in chunks of `size` bytes: the answer's status and the seconds to it."""
    parts = (body[k : k + size] for k in range(0, len(body), size))
    chunks = b"".join(b"%x\r\n%s\r\n" % (len(part), part) for part in parts)
    head = (
        b"POST /embed HTTP/1.1\r\nhost: [::1]\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n"
    )
    with socket.create_connection(("127.0.0.1", port), timeout=120) as sock:
        start = time.perf_counter()
        with contextlib.suppress(OSError):  # refused and closed before all of it was sent
            sock.sendall(head + chunks + b"0\r\n\r\n")
        status = sock.recv(12)[9:12].decode() or "closed"
        return status, time.perf_counter() - start


def tiny_chunks(model: Path, tree: Path, size: int = 7_000_000) -> str:
    """The server's CPU for a 7 MB body in 64 KB chunks, then in 1-byte chunks."""
    server, _, port = start_server(model, root=tree)
    try:
        body = b'{"sentences": [["a"]], "pooling": "mean"}'.ljust(size, b" ")
        figures = []
        for chunk in (65536, 1):
            before = cpu_seconds(server.pid)
            status, seconds = _chunked(port, body, chunk)
            time.sleep(0.5)  # what the server still does with it
            figures.append((status, seconds, cpu_seconds(server.pid) - before))
        (s64, t64, c64), (s1, t1, c1) = figures
        return (f"64 KB chunks: {s64} in {t64:.2f} s, {c64:.2f} s of server CPU; 1-byte chunks: {s1} in {t1:.2f} s, "
                f"{c1:.2f} s of server CPU ({c1 / max(c64, 0.01):.1f}x)")  # fmt: skip
    finally:
        server.terminate()
        server.wait(timeout=60)


ROWS: dict[str, Row] = {
    "stalled-uploads": ("ten uploads stalled, holding the whole body budget", on_server(
        lambda s: stalled_uploads(s.port, s.url))),
    "body-trickle": ("8 connections holding the body budget at about 4 Mbit/s", on_server(
        lambda s: budget_at_4_mbits(s.url, s.port))),
    "slow-readers": ("readers that never read the static files' answers", slow_static_readers),
    "early-answers": ("answered 401 before the body came, then one more byte", early_answers_then_a_byte),
    "tiny-chunks": ("a 7 MB body in 1-byte chunks", tiny_chunks),
}  # fmt: skip
