"""Large and unread answers: small clients beside answers at the answer limit, clients that never read their
all-layer answers, and connections that pipeline requests and never read the answers."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections import Counter

import httpx
import numpy as np
import orjson

from bench.common import percentiles
from bench.hostile.parts import JSON, OPTIONS, SMALL, PeakRss, Row, memory, on_server, post_bytes


def maximal_request(url: str) -> tuple[bytes, int]:
    info = httpx.get(f"{url}/info").json()
    limits, dim, layers = info["limits"], info["dim"], info["num_layers"]
    per_sentence = 126 * layers * (dim * limits["answer_bytes_per_number"]["float"] + 3)
    n = min(limits["max_sentences"], limits["max_answer_bytes"] // per_sentence)
    words = ["the", "bank", "of", "a", "river", "is", "where", "the", "water", "meets", "the", "land"]
    sentences = [[words[(k + j) % len(words)] for j in range(125)] + [f"s{k}"] for k in range(n)]
    return orjson.dumps({"sentences": sentences, "output": "layers"}), n


async def normal_clients(url: str, clients: int, stop: asyncio.Event) -> tuple[list[float], Counter]:
    latencies, statuses = [], Counter()
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:

        async def client():
            while not stop.is_set():
                start = time.perf_counter()
                try:
                    status = (await http.post("/embed", content=SMALL, headers=JSON)).status_code
                except httpx.TransportError as err:
                    status = type(err).__name__
                latencies.append(time.perf_counter() - start)
                statuses[status] += 1
                await asyncio.sleep(0.02)

        await asyncio.gather(*(client() for _ in range(clients)))
    return latencies, statuses


async def beside_maximal_answers(url: str, clients: int, repeats: int = 3) -> None:
    body, n = maximal_request(url)
    stop = asyncio.Event()
    normal = asyncio.ensure_future(normal_clients(url, clients, stop))
    await asyncio.sleep(1)
    sizes, seconds = [], []
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        for _ in range(repeats):
            start = time.perf_counter()
            response = await http.post("/embed", content=body, headers=JSON)
            seconds.append(time.perf_counter() - start)
            assert response.status_code == 200, response.text[:200]
            sizes.append(len(response.content))
    stop.set()
    latencies, statuses = await normal
    p = percentiles(latencies)
    print(f"maximal answers ({n} sentences of 126 tokens, per layer, {np.mean(sizes) / 2**20:.0f} MiB of JSON, "
          f"{np.mean(seconds):.2f} s each, {repeats} in a row): {clients} small clients' latency p50 {p['p50']:.3f} s, "
          f"p99 {p['p99']:.3f} s, max {max(latencies):.3f} s over {len(latencies)} requests; "
          f"statuses {dict(statuses)} (goal: p99 <= 0.5 s)")  # fmt: skip


def unread_answers(url: str, port: int, pid: int, clients: int = 40, wait_s: float = 120) -> None:
    body = orjson.dumps({"sentences": ["a " * 963] * 2, "output": "layers", "layers": [0, 1, 2, 0, 1, 2, 0, 1]})
    with PeakRss(pid) as rss:
        socks = []
        for _ in range(clients):
            sock = socket.create_connection(("127.0.0.1", port))
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # reads nothing, and lets little in
            sock.sendall(post_bytes("/embed", body))
            socks.append(sock)
        start = time.monotonic()
        status: dict[int, str] = {}
        while len(status) < clients and time.monotonic() < start + wait_s:  # until all are answered
            time.sleep(1)
            for k, sock in enumerate(socks):
                with contextlib.suppress(BlockingIOError):  # peeked: nothing is read
                    status[k] = sock.recv(12, socket.MSG_PEEK | socket.MSG_DONTWAIT)[9:12].decode()
        statuses = Counter(status.values())
        answered = time.monotonic() - start
        held = rss.grown_mb
        reset: dict[int, float] = {}  # the answered connections the server reset, and when
        while len(reset) < statuses["200"] and time.monotonic() < start + wait_s:
            for k, sock in enumerate(socks):
                # TCP_INFO's first byte is the connection's state: 1 while established (a reset is not seen by a
                # read while answer bytes wait in the socket); a 503 is closed by the keep-alive timeout instead
                if status.get(k) != "200" or k in reset:
                    continue
                if sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 8)[0] != 1:
                    reset[k] = time.monotonic() - start
            time.sleep(0.2)
    for sock in socks:
        sock.close()
    after = f"closed after {max(reset.values()):.0f} s" if reset else f"not closed within {wait_s:.0f} s"
    print(
        f"{clients} clients that never read all-layer answers ({len(body) / 1e3:.1f} KB requests): statuses "
        f"{dict(statuses)} within {answered:.0f} s, RSS +{held:.0f} MB then (peak +{rss.grown_mb:.0f} MB); the "
        f"{statuses['200']} answered connections {after} (goal: < +300 MB; closed by a write timeout)"
    )


def unread_pipelines(url: str, port: int, pid: int, connections: int = 60) -> None:
    head = b"GET /health/live HTTP/1.1\r\nhost: [::1]\r\n\r\n"
    data = head * (256 * 1024 // len(head))
    with PeakRss(pid) as rss, httpx.Client(base_url=url, timeout=120) as client:
        socks = []
        for _ in range(connections):
            sock = socket.create_connection(("127.0.0.1", port))
            sock.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                sock.send(data)
            socks.append(sock)
        latencies = []
        for _ in range(50):
            start = time.perf_counter()
            assert client.post("/embed", content=SMALL, headers=JSON).status_code == 200
            latencies.append(time.perf_counter() - start)
            time.sleep(0.02)
    for sock in socks:
        sock.close()
    time.sleep(1)
    p = percentiles(latencies)
    print(
        f"{connections} connections pipelining {len(data) >> 10} KiB of GETs each ({len(data) // len(head)} "
        f"requests), never reading: RSS +{rss.grown_mb:.0f} MB at most, {memory(pid, 'VmRSS') / 1e6:.0f} MB once "
        f"they closed; a small POST p50 {p['p50']:.3f} s, p99 {p['p99']:.3f} s (goal: < +200 MB, p99 < 1 s)"
    )


ROWS: dict[str, Row] = {
    "maximal-answers": ("small clients beside answers at the answer limit", on_server(
        lambda s: asyncio.run(beside_maximal_answers(s.url, OPTIONS["clients"])))),
    "unread-answers": ("40 clients that never read their all-layer answers", on_server(
        lambda s: unread_answers(s.url, s.port, s.pid))),
    "unread-pipelines": ("60 connections pipelining GETs, never reading", on_server(
        lambda s: unread_pipelines(s.url, s.port, s.pid))),
}  # fmt: skip
