"""Requests whose framing or headers lie: an API key in a chunked trailer, malformed chunks and a thousand
trailers, pipelined requests closed at once, WebSocket upgrades with 8 KB paths, and X-Forwarded-For spoofed
from an address that is no proxy."""

from __future__ import annotations

import socket
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx

from bench.common import start_server
from bench.hostile.parts import Row, answered, log_size


def with_keys(model: Path, tree: Path) -> None:
    log = Path(tempfile.mkdtemp()) / "server.log"
    settings = {"ELMO_API_KEYS": "bench-key", "ELMO_LOG_LEVEL": "info"}
    server, _, port = start_server(model, root=tree, settings=settings, log=log)
    try:
        body = b'{"sentences": [["a"]]}'
        head = (
            b"POST /embed HTTP/1.1\r\nhost: [::1]\r\ncontent-type: application/json\r\n"
            b"transfer-encoding: chunked\r\n\r\n"
        )
        chunked = head + b"%x\r\n" % len(body) + body + b"\r\n0\r\n"
        with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
            sock.sendall(chunked + b"authorization: Bearer bench-key\r\n\r\n")
            status = sock.recv(4096).split(b" ")[1].decode()
        print(f"Authorization: Bearer <key> in a chunked trailer: {status} (goal: 401)")
        timed = {}
        keyed = b"authorization: Bearer bench-key\r\ntransfer-encoding"
        for name, data in {"malformed chunk-size line": head + b"zz\r\n" + body,
                           "1000 trailers": chunked + b"x-t: 1\r\n" * 1000 + b"\r\n"}.items():  # fmt: skip
            start = time.perf_counter()
            with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
                sock.sendall(data.replace(b"transfer-encoding", keyed, 1))
                timed[name] = (sock.recv(4096).split(b" ")[1].decode(), time.perf_counter() - start)
        print("    " + ", ".join(f"{name}: {s} in {t:.2f} s" for name, (s, t) in timed.items()))
        logged = log.stat().st_size
        for _ in range(200):
            with socket.create_connection(("127.0.0.1", port)) as sock:
                sock.sendall(b"GET /health/live HTTP/1.1\r\nhost: [::1]\r\n\r\n" * 2)
        time.sleep(2)
        print(f"    200 connections of two pipelined GETs, closed at once: {log.stat().st_size - logged} bytes of log")
    finally:
        server.terminate()
        server.wait(timeout=60)


def upgrade_requests(model: Path, tree: Path, count: int = 300) -> None:
    """WebSocket upgrade requests with 8 KB paths and queries, on a server with an API key."""
    log = Path(tempfile.mkdtemp()) / "server.log"
    settings = {"ELMO_LOG_LEVEL": "info", "ELMO_API_KEYS": "bench-key"}
    server, _, port = start_server(model, root=tree, settings=settings, log=log)
    try:
        time.sleep(0.5)
        before = log_size(log)
        marker = "SecretText"
        statuses = Counter()
        for k in range(count):
            path = f"/embed?sentences={marker}{k}-" + "x" * 8000
            head = (f"GET {path} HTTP/1.1\r\nhost: [::1]\r\nconnection: Upgrade\r\nupgrade: websocket\r\n"
                    "sec-websocket-version: 13\r\nsec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n")  # fmt: skip
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
                    sock.sendall(head.encode())
                    statuses[sock.recv(12)[9:12].decode() or "closed"] += 1
            except OSError as err:
                statuses[type(err).__name__] += 1
        time.sleep(1)
        grown = log_size(log) - before
        text = log.read_text(errors="replace")
        print(f"{count} WebSocket upgrade requests of 8 KB paths with a query, on a server with an API key: "
              f"answered {dict(statuses)}; {grown} bytes of log ({grown / count:.0f} a request), request text in "
              f"it: {marker in text} (goal: < 64 KB for {count}, no request text)")  # fmt: skip
    finally:
        server.terminate()
        server.wait(timeout=60)


def _held_bytes(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    found = [line.split()[-1] for line in text.splitlines() if line.startswith("elmo_body_bytes_held")]
    return float(found[0]) if found else 0.0


def spoofed_forwarded_for(model: Path, tree: Path) -> None:
    """Stalled 8 MiB uploads from one address, each with another X-Forwarded-For."""
    server, url, port = start_server(model, root=tree)
    try:
        socks = []
        for k in range(4):
            sock = socket.create_connection(("127.0.0.1", port), timeout=30)
            head = (f"POST /embed HTTP/1.1\r\nhost: [::1]\r\nx-forwarded-for: 203.0.113.{k + 1}\r\n"
                    f"content-type: application/json\r\ncontent-length: {8 << 20}\r\n\r\n")  # fmt: skip
            sock.sendall(head.encode() + b"x" * ((8 << 20) - 16))
            socks.append(sock)
        time.sleep(2)
        held = _held_bytes(url)
        statuses = Counter(answered(sock) for sock in socks)
        print(f"four 8 MiB uploads from 127.0.0.1, stalled, each with another X-Forwarded-For: "
              f"{held / 2**20:.1f} MiB of bodies held ({held / (8 << 20):.1f} bodies), the uploads' answers "
              f"{dict(statuses)} (goal: at most the per-address budget, 16 MiB: 2 bodies)")  # fmt: skip
        for sock in socks:
            sock.close()
    finally:
        server.terminate()
        server.wait(timeout=60)


ROWS: dict[str, Row] = {
    "trailers": ("an API key in a chunked trailer, bad chunks, pipelined GETs closed at once", with_keys),
    "upgrades": ("WebSocket upgrades with 8 KB paths", upgrade_requests),
    "forwarded": ("X-Forwarded-For spoofed from an address that is no proxy", spoofed_forwarded_for),
}  # fmt: skip
