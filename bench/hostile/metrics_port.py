"""The metrics port (ELMO_METRICS_PORT) attacked: 1,000 connections from 100 addresses sending huge or slow heads,
and eight scrapers in a loop, beside the main port's requests."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import httpx
import orjson

from bench.common import start_server
from bench.hostile.parts import JSON, Liveness, PeakRss, Row, cpu_seconds

SMALL = orjson.dumps({"sentences": [["The", "bank", "of", "the", "river", "."]], "pooling": "mean"})


class MainPort(Liveness):
    """Small POSTs to the main port from 127.0.0.3, one every 20 ms on a thread of its own: their latencies."""

    def __init__(self, url: str):
        super().__init__(url)
        self.times: list[float] = []

    def _poll(self) -> None:
        transport = httpx.HTTPTransport(local_address="127.0.0.3")
        with httpx.Client(base_url=self.url, transport=transport, timeout=120) as client:
            while not self.stop.is_set():
                start = time.perf_counter()
                client.post("/embed", content=SMALL, headers=JSON)
                self.times.append(time.perf_counter() - start)
                time.sleep(0.02)

    def figures(self) -> str:
        import numpy as np

        p50, p99 = np.percentile(self.times, [50, 99]) * 1e3
        return f"main port p50 {p50:.0f} ms, p99 {p99:.0f} ms ({len(self.times)} requests)"


def _gone(sock: socket.socket) -> bool:
    """Whether the server has closed this non-blocking socket (what it answered first is read and dropped)."""
    try:
        while sock.recv(65536):
            pass
        return True  # EOF
    except BlockingIOError:
        return False
    except OSError:
        return True  # reset


def _hostile_metrics_connections(port: int, count: int, seconds: float) -> tuple[int, int]:
    """`count` connections to the metrics port from 100 addresses: half send 1 MB of header lines of 60 KB (never
    ending the head), half a request line and then one byte a second, for `seconds`; (connected, closed by the
    server by the end)."""
    import selectors

    huge: dict[socket.socket, int] = {}  # bytes left to send
    slow: list[socket.socket] = []
    line = b"x-filler: " + b"a" * 60_000 + b"\r\n"
    pending, chooser = {}, selectors.DefaultSelector()
    for k in range(count):  # all at once, not one after the other: a listen backlog of 5 drops SYNs
        sock = socket.socket()
        sock.setblocking(False)
        sock.bind((f"127.0.{10 + k // 100}.{1 + k % 100}", 0))
        sock.connect_ex(("127.0.0.1", port))
        pending[sock] = k
        chooser.register(sock, selectors.EVENT_WRITE)
    deadline = time.monotonic() + 10
    while pending and time.monotonic() < deadline:
        for key, _ in chooser.select(0.1):
            sock, k = key.fileobj, pending.pop(key.fileobj)
            chooser.unregister(sock)
            try:
                if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
                    raise OSError
                sock.send(b"GET /metrics HTTP/1.1\r\nhost: x\r\n" + (b"x-slow: " if k % 2 else b""))
            except OSError:
                sock.close()
                continue
            if k % 2:
                slow.append(sock)
            else:
                huge[sock] = 1 << 20
    for sock in pending:
        sock.close()
    chooser.close()
    closed: set[socket.socket] = set()
    end, tick = time.monotonic() + seconds, 0.0
    while time.monotonic() < end:
        for sock, left in huge.items():  # 1 MB each, as fast as the server reads it
            if left > 0 and sock not in closed:
                try:
                    huge[sock] = left - sock.send(line[: min(len(line), left)])
                except BlockingIOError:
                    pass
                except OSError:
                    closed.add(sock)
        if time.monotonic() >= tick:  # the slow ones: a byte a second
            tick = time.monotonic() + 1
            for sock in slow:
                if sock not in closed:
                    try:
                        sock.send(b"a")
                    except BlockingIOError:
                        pass
                    except OSError:
                        closed.add(sock)
        time.sleep(0.01)
    closed |= {sock for sock in [*huge, *slow] if sock not in closed and _gone(sock)}
    for sock in [*huge, *slow]:
        sock.close()
    return len(huge) + len(slow), len(closed)


def _scrapers(port: int, threads: int, seconds: float) -> int:
    """`threads` scrapers looping on the metrics port for `seconds`: how many scrapes they made."""
    from concurrent.futures import ThreadPoolExecutor

    end = time.monotonic() + seconds

    def scraper(_) -> int:
        made = 0
        with httpx.Client(timeout=30) as client:
            while time.monotonic() < end:
                client.get(f"http://127.0.0.1:{port}/metrics")
                made += 1
        return made

    with ThreadPoolExecutor(threads) as pool:
        return sum(pool.map(scraper, range(threads)))


def metrics_port(model: Path, tree: Path, seconds: float = 8, count: int = 1000, attack_s: float = 12) -> str:
    """The main port's p99 alone; beside `count` slow or huge-header connections to the metrics port (the
    server's RSS growth, how many it closed); beside eight scrapers looping on it (scrapes a second)."""
    import multiprocessing

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        mport = sock.getsockname()[1]
    server, url, _ = start_server(model, root=tree, settings={"ELMO_METRICS_PORT": str(mport)})
    figures = []
    try:
        cpu = cpu_seconds(server.pid)
        with MainPort(url) as alone:
            time.sleep(seconds)
        cpu = cpu_seconds(server.pid) - cpu
        figures.append(f"alone: {alone.figures()}, server CPU {cpu:.1f} s in {seconds:g} s")
        # the attackers in processes of their own: their Python would otherwise slow the probe's (one GIL)
        spawn = multiprocessing.get_context("spawn")
        with spawn.Pool(1) as attacker:
            cpu = cpu_seconds(server.pid)
            with PeakRss(server.pid) as rss, MainPort(url) as attacked:
                connected, closed = attacker.apply(_hostile_metrics_connections, (mport, count, attack_s))
            cpu = cpu_seconds(server.pid) - cpu
            time.sleep(1)
            after = PeakRss(server.pid)
            figures.append(
                f"{count} slow or huge-header connections to the metrics port ({connected} connected, {closed} closed "
                f"by the server within {attack_s:g} s): RSS +{rss.grown_mb:.0f} MB at the peak, "
                f"+{(after.start - rss.start) / 1e6:.0f} MB once closed, server CPU {cpu:.1f} s, {attacked.figures()}"
            )
            cpu = cpu_seconds(server.pid)
            with MainPort(url) as scraped:
                scrapes = attacker.apply(_scrapers, (mport, 8, seconds))
            cpu = cpu_seconds(server.pid) - cpu
        figures.append(
            f"eight scrapers in a loop ({scrapes / seconds:.0f} scrapes/s, server CPU {cpu:.1f} s in {seconds:g} s "
            f"with the main port's requests): {scraped.figures()}"
        )
    finally:
        server.terminate()
        server.wait(timeout=60)
    return "; ".join(figures)


ROWS: dict[str, Row] = {
    "metrics-port": ("hostile connections and scrapers on the metrics port", metrics_port),
}
