"""The HTTP server below the app, against real elmo-serve processes: the
answers that never change cost a reader only what it reads, connections are capped per address and in all below
an open-files limit the server raises, WebSocket upgrades are refused before anything logs them, forwarded headers
count only from the proxies named, and the liveness probe is answered outside the requests' turns.
`python -m bench.hostile --rows slow-readers,descriptors,upgrades,forwarded` measures the same attacks at full
size."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import fastapi_offline
import httpx
import pytest

from tests.live_server import counter, raw_exchange, rss_bytes, running_server

STATIC = Path(fastapi_offline.__file__).parent / "static"
BUNDLE = "/static-offline-docs/swagger-ui-bundle.js"  # 1.5 MB
MIB = 1 << 20


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    with running_server(tiny_model_dir, tmp_path_factory.mktemp("connections")) as s:  # the default limits
        yield s


def get(path: str, extra: bytes = b"") -> bytes:
    return b"GET " + path.encode() + b" HTTP/1.1\r\nhost: 127.0.0.1\r\n" + extra + b"\r\n"


def from_address(address: str, port: int, receive_window: int | None = None) -> socket.socket:
    sock = socket.socket()
    if receive_window is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_window)  # before connecting: it is advertised
    sock.bind((address, 0))
    sock.connect(("127.0.0.1", port))
    return sock


def unsent_bytes(port: int) -> list[int]:
    """What the kernel holds unsent or unacknowledged on each of the server's connections on `port` (tx_queue in
    /proc/net/tcp): the server's side of each, by its local port."""
    held = []
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        local, state, queues = fields[1], fields[3], fields[4]
        if int(local.split(":")[1], 16) == port and state == "01":  # established
            held.append(int(queues.split(":")[0], 16))
    return held


def test_the_docs_files_are_served_whole_with_an_etag(client):
    want = (STATIC / "swagger-ui-bundle.js").read_bytes()
    response = client.get(BUNDLE)
    assert response.status_code == 200 and response.content == want
    assert response.headers["content-type"] == "text/javascript; charset=utf-8"  # as StaticFiles named it
    assert int(response.headers["content-length"]) == len(want)
    again = client.get(BUNDLE, headers={"if-none-match": response.headers["etag"]})
    assert again.status_code == 304 and again.content == b""
    head = client.head(BUNDLE)
    assert head.status_code == 200 and head.content == b"" and int(head.headers["content-length"]) == len(want)
    assert client.get(BUNDLE, headers={"range": "bytes=0-9"}).content == want  # no ranges: the whole of it
    assert client.get("/static-offline-docs/no-such-file.js").status_code == 404


def test_the_openapi_document_is_encoded_once_and_pipelines_in_order(server, client):
    document = client.get("/openapi.json")
    assert document.status_code == 200 and document.json()["info"]["title"] == "ELMo embeddings"
    assert "/embed" in document.json()["paths"]
    answers = raw_exchange(server.port, get("/openapi.json") * 16, answers=16)
    assert [status for status, _, _ in answers] == [200] * 16
    assert {body for _, _, body in answers} == {document.content}


def test_readers_that_never_read_the_docs_cost_no_copy_each(server, client):
    # 400 connections from 8 addresses ask for the 1.5 MB bundle with a 1 KB receive window and never read. Each
    # cost about 213 KB of the server's memory (a chunk read from the file for it, and its copy in the buffers),
    # and the kernel took the whole bundle into each one's send buffer (3.7 MB of kernel memory each).
    before = rss_bytes(server.pid)
    readers = [from_address(f"127.0.3.{1 + k % 8}", server.port, receive_window=1024) for k in range(400)]
    for sock in readers:
        sock.sendall(get(BUNDLE))
    start = time.monotonic()
    live = client.get("/health/live")
    live_s = time.monotonic() - start
    time.sleep(2)
    grown, kernel = rss_bytes(server.pid) - before, unsent_bytes(server.port)
    for sock in readers:
        sock.close()
    print(f"400 readers that never read: +{grown / MIB:.1f} MiB, the kernel holding at most {max(kernel)} bytes of "
          f"one's answer; /health/live meanwhile in {live_s:.3f} s")  # fmt: skip
    assert live.status_code == 200
    assert grown < 40 * MIB  # 85 MB before
    assert len(kernel) >= 400 and max(kernel) < 256 << 10  # 1.5 MB each before


def idle_connections(address: str, port: int, count: int) -> list[socket.socket]:
    """`count` connections from `address` that send nothing (opened without waiting for each handshake)."""
    socks = []
    for _ in range(count):
        sock = socket.socket()
        sock.setblocking(False)
        sock.bind((address, 0))
        sock.connect_ex(("127.0.0.1", port))
        socks.append(sock)
    return socks


def turned_away(sock: socket.socket, timeout: float = 5) -> bytes | None:
    """What the server sent on a connection before closing it (b"" if nothing); None if it is still open after
    `timeout`."""
    sock.setblocking(True)
    sock.settimeout(timeout)
    got = b""
    try:
        while chunk := sock.recv(4096):
            got += chunk
    except TimeoutError:
        return None
    except ConnectionResetError:
        pass
    return got


def test_one_address_cannot_take_the_descriptors_of_a_1024_limit(tiny_model_dir, tmp_path):
    # The common limit of 1024 open files, soft and hard: 1,100 connections from one address that send nothing
    # took every descriptor, accept() failed, and 127 of 150 requests from other addresses were reset.
    with running_server(tiny_model_dir, tmp_path, {"ELMO_LOG_LEVEL": "info"}, open_files=(1024, 1024)) as server:
        idle = idle_connections("127.0.0.2", server.port, 1100)
        time.sleep(1)
        statuses = []
        for _ in range(30):  # each on a new connection, as most one-off clients and probes come
            with httpx.Client(transport=httpx.HTTPTransport(local_address="127.0.0.3"), timeout=10) as other:
                statuses.append(other.post(f"{server.url}/embed", json={"sentences": [["a", "b"]]}).status_code)
        refusal = turned_away(idle[-1])
        for sock in idle:
            sock.close()
        with httpx.Client(base_url=server.url) as client:
            refused = counter(client, "elmo_connections_refused_total", reason="per_client")
            limits = client.get("/info").json()["limits"]
        log = server.log.read_text()
    assert statuses == [200] * 30
    assert limits["max_connections"] == 1024 - 102 and limits["max_connections_per_client"] == 461
    assert refusal is not None and refusal.startswith(b"HTTP/1.1 503 ") and b"retry-after: 1" in refusal, refusal
    detail = json.loads(refusal.split(b"\r\n\r\n", 1)[1])["detail"]
    assert detail == "connections: 461 open from your address; the limit is 461 per address: close some, or retry later"
    assert refused == 1100 - 461
    lines = [line for line in log.splitlines() if "refused a connection from 127.0.0.2" in line]
    assert len(lines) == 1, lines  # one line per address every 10 s, whatever the count
    assert "it has 461 open, the limit per address of 461 (ELMO_MAX_CONNECTIONS_PER_CLIENT)" in lines[0]
    assert "open files: 1024; connections: at most 922, 461 from one address" in log


def test_the_open_files_limit_is_raised_to_the_hard_one(tiny_model_dir, tmp_path):
    with running_server(tiny_model_dir, tmp_path, {"ELMO_LOG_LEVEL": "info"}, open_files=(1024, 4096)) as server:
        limits = httpx.get(f"{server.url}/info").json()["limits"]
        log = server.log.read_text()
    assert limits["max_connections"] == 4096 - 409 and limits["max_connections_per_client"] == 512
    assert "open files: raised from 1024 to 4096; connections: at most 3687, 512 from one address" in log


def test_at_the_limit_in_all_the_largest_holder_loses_an_idle_connection(tiny_model_dir, tmp_path):
    settings = {"ELMO_MAX_CONNECTIONS": "20", "ELMO_MAX_CONNECTIONS_PER_CLIENT": "10"}
    with running_server(tiny_model_dir, tmp_path, settings) as server:
        first = idle_connections("127.0.0.2", server.port, 10)
        time.sleep(0.3)
        second = idle_connections("127.0.0.3", server.port, 10)
        time.sleep(0.3)
        # the 21st connection takes the place of the oldest idle one of the address holding the most (the first)
        ((status, _, body),) = raw_exchange(server.port, get("/health/ready"), answers=1)
        evicted, kept = turned_away(first[0]), turned_away(first[1], timeout=0.2)
        # every connection busy (a request head begun): the next one is turned away
        busy = [from_address("127.0.0.4", server.port)]
        for sock in [*first[1:], *second, *busy]:
            sock.setblocking(True)
            sock.sendall(b"GET /health/live HTTP/1.1\r\nhost: [::1]\r\n")  # and never the rest
        time.sleep(0.3)
        newcomer = from_address("127.0.0.5", server.port)
        refusal = turned_away(newcomer)
        for sock in [*first, *second, *busy, newcomer]:
            sock.close()
    assert status == 200, body
    assert evicted == b"" and kept is None  # the oldest closed without a word; the next one still open
    assert refusal is not None and refusal.startswith(b"HTTP/1.1 503 "), refusal
    assert b"connections: the server holds its limit of 20; retry later" in refusal


def test_websocket_upgrades_are_refused_before_anything_logs_them(tiny_model_dir, tmp_path):
    # uvicorn logged each upgrade request with its path and query ("WebSocket /embed?sentences=..." 403), with API
    # keys on too: 5,000 of 8 KB wrote 40.5 MB of log in 2.9 s, and request text reached the log.
    settings = {"ELMO_LOG_LEVEL": "info", "ELMO_API_KEYS": "a-key"}
    with running_server(tiny_model_dir, tmp_path, settings) as server:
        time.sleep(0.5)
        logged = server.log.stat().st_size
        upgrade = b"connection: Upgrade\r\nupgrade: websocket\r\nsec-websocket-version: 13\r\n"
        upgrade += b"sec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
        for k in range(300):
            path = f"/embed?sentences=Secret-{k}-" + "x" * 8000
            ((status, headers, body),) = raw_exchange(server.port, get(path, upgrade), answers=2)
            assert status == 400 and headers["connection"] == "close", body
            assert json.loads(body)["detail"].startswith("upgrade: this server speaks no WebSocket")
        # another upgrade (h2c, as curl --http2 asks): answered as HTTP/1.1, and the connection closed after it
        h2c = b"connection: Upgrade, HTTP2-Settings\r\nupgrade: h2c\r\nhttp2-settings: AAMAAABkAAQAAP__\r\n"
        answers = raw_exchange(server.port, get("/health/ready", h2c) + get("/health/ready"), answers=2)
        time.sleep(0.5)
        added = server.log.read_bytes()[logged:]
    assert [status for status, _, _ in answers] == [200] and answers[0][1]["connection"] == "close"
    assert len(added) < 64 << 10 and b"Secret-" not in added, added[:2000]


STALLED = 8 << 20  # each upload declares this, sends all but 16 bytes and stops


def stalled_upload(port: int, source: str, forwarded_for: str) -> socket.socket:
    sock = from_address(source, port)
    head = (f"POST /embed HTTP/1.1\r\nhost: [::1]\r\nx-forwarded-for: {forwarded_for}\r\ncontent-type: application/json"
            f"\r\ncontent-length: {STALLED}\r\n\r\n")  # fmt: skip
    sock.sendall(head.encode() + b"x" * (STALLED - 16))
    return sock


def refused_503(sock: socket.socket) -> bytes:
    """The detail of a 503 the server answered on `sock` within a second, or b"" while it holds the upload."""
    sock.settimeout(1)
    try:
        got = sock.recv(4096)
    except TimeoutError:
        return b""
    return got.split(b"\r\n\r\n", 1)[1] if got.startswith(b"HTTP/1.1 503 ") else got


def test_forwarded_headers_count_only_from_the_proxies_named(tiny_model_dir, tmp_path):
    # uvicorn trusted X-Forwarded-For from 127.0.0.1 by default: any local process chose its address, and held
    # 4 bodies of 8 MiB at once where one address may hold 2 (16 MiB).
    (tmp_path / "default").mkdir()
    with running_server(tiny_model_dir, tmp_path / "default") as server:
        uploads = [stalled_upload(server.port, "127.0.0.1", f"203.0.113.{k}") for k in range(1, 5)]
        answers = [refused_503(sock) for sock in uploads]
        with httpx.Client(base_url=server.url) as client:
            held = counter(client, "elmo_body_bytes_held")
        for sock in uploads:
            sock.close()
    # which two are held depends on how the server reads them: two are, and two are refused
    assert held == 2 * (STALLED - 16) and answers.count(b"") == 2, answers
    assert sum(b"from your address hold" in answer for answer in answers) == 2, answers
    # Named as the proxy: the client it names is the address (two bodies each); another peer's header is its own.
    (tmp_path / "proxy").mkdir()
    settings = {"ELMO_FORWARDED_ALLOW_IPS": "127.0.0.1", "ELMO_MAX_CONNECTIONS_PER_CLIENT": "3"}
    with running_server(tiny_model_dir, tmp_path / "proxy", settings) as server:
        proxied = [stalled_upload(server.port, "127.0.0.1", f"203.0.113.{1 + k // 2}") for k in range(4)]
        spoofed = [stalled_upload(server.port, "127.0.0.2", f"203.0.113.{k + 5}") for k in range(3)]
        proxied_answers, spoofed_answers = [refused_503(s) for s in proxied], [refused_503(s) for s in spoofed]
        extra = [from_address("127.0.0.1", server.port) for _ in range(3)]  # the proxy is not capped per address
        # 127.0.0.2's fourth connection is capped; the one whose upload was answered 503 before its body came is
        # closed 5 s after its answer (the keep-alive timeout), so it may be gone: open more until one is refused
        more, beyond_answer = [], None
        while beyond_answer is None and len(more) < 3:
            more.append(from_address("127.0.0.2", server.port))
            beyond_answer = turned_away(more[-1], timeout=2)
        for sock in [*proxied, *spoofed, *extra, *more]:
            sock.close()
    assert proxied_answers == [b""] * 4
    assert spoofed_answers.count(b"") == 2 and sum(b"from your address hold" in a for a in spoofed_answers) == 1
    assert beyond_answer is not None and beyond_answer.startswith(b"HTTP/1.1 503 ")
    assert b"3 open from your address" in beyond_answer
