"""What the attacks of bench/hostile/ share: the server's memory and CPU time, the CPU line printed beside every
figure, the liveness and RSS samplers, a prober from another address, raw requests, and the runner of rows against
one checkout or before and after a fix, back to back (a row: a title and a function of (model, tree) that serves
the tree's code and returns its figures, or prints them itself and returns None)."""

from __future__ import annotations

import os
import re
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
import orjson

from bench.common import percentiles, start_server

Row = tuple[str, Callable[[Path, Path], str | None]]  # a title, and (model, tree) -> its figures
SMALL = orjson.dumps({"sentences": [["The", "bank", "of", "the", "river", "."]], "pooling": "mean"})
BOMB = orjson.dumps({"sentences": ["a," * 4_000_000]})
JSON = {"content-type": "application/json"}
# What some rows take from the command line (python -m bench.hostile --clients, --seconds): set by the runner
OPTIONS = {"clients": 4, "seconds": 30.0}


def memory(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(field)


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def cpu_line() -> str:
    flags = re.search(r"^flags\s*:(.*)$", Path("/proc/cpuinfo").read_text(), re.M)
    wanted = ("avx", "avx2", "fma", "avx512f", "avx512_vnni", "amx_tile")
    have = [f for f in wanted if flags and f in flags.group(1).split()]
    return f"{os.cpu_count()} cores, flags {' '.join(have) or 'none of avx/avx2/avx512'}, load {os.getloadavg()[0]:.1f}"


class Liveness:
    """Polls /health/live every 20 ms on a thread of its own; the slowest answer seen while running."""

    def __init__(self, url: str):
        self.url, self.stop, self.slowest = url, threading.Event(), 0.0
        self.thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        with httpx.Client(base_url=self.url, timeout=120) as client:
            while not self.stop.is_set():
                start = time.perf_counter()
                client.get("/health/live")
                self.slowest = max(self.slowest, time.perf_counter() - start)
                time.sleep(0.02)

    def __enter__(self) -> Liveness:
        self.thread.start()
        return self

    def __exit__(self, *_) -> None:
        self.stop.set()
        self.thread.join()


class PeakRss:
    """The server's largest VmRSS, sampled every 50 ms while running, above what it was at the start."""

    def __init__(self, pid: int):
        self.pid, self.stop = pid, threading.Event()
        self.start = self.peak = memory(pid, "VmRSS")
        self.thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self.stop.is_set():
            self.peak = max(self.peak, memory(self.pid, "VmRSS"))
            time.sleep(0.05)

    @property
    def grown_mb(self) -> float:
        return (self.peak - self.start) / 1e6

    def __enter__(self) -> PeakRss:
        self.thread.start()
        return self

    def __exit__(self, *_) -> None:
        self.stop.set()
        self.thread.join()


class Probe:
    """Requests from one other address on a thread of its own, every `every` s, each on a new connection (as a
    kubelet's probes and most one-off clients come): their latencies, and their failures by kind."""

    def __init__(self, url: str, address: str, every: float = 0.2, path: str = "/health/live", body: bytes = b""):
        self.url, self.address, self.every, self.path, self.body = url, address, every, path, body
        self.stop, self.seconds, self.outcomes = threading.Event(), [], Counter()
        self.thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        transport = httpx.HTTPTransport(local_address=self.address)
        while not self.stop.is_set():
            start = time.perf_counter()
            try:
                with httpx.Client(transport=transport, base_url=self.url, timeout=30) as client:
                    if self.body:
                        outcome = client.post(self.path, content=self.body, headers=JSON).status_code
                    else:
                        outcome = client.get(self.path).status_code
            except httpx.TransportError as err:
                outcome = type(err).__name__
            self.seconds.append(time.perf_counter() - start)
            self.outcomes[outcome] += 1
            self.stop.wait(max(0.0, self.every - (time.perf_counter() - start)))

    @property
    def served(self) -> float:
        return self.outcomes[200] / max(1, sum(self.outcomes.values()))

    def figures(self) -> str:
        p = percentiles(self.seconds) if self.seconds else {"p50": 0.0, "p99": 0.0}
        return (f"{sum(self.outcomes.values())} requests, {self.served:.1%} answered 200 ({dict(self.outcomes)}), "
                f"p50 {p['p50']:.3f} s, p99 {p['p99']:.3f} s, max {max(self.seconds, default=0):.3f} s")  # fmt: skip

    def __enter__(self) -> Probe:
        self.thread.start()
        return self

    def __exit__(self, *_) -> None:
        self.stop.set()
        self.thread.join()


def from_address(address: str, port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=60, source_address=(address, 0))


def post_bytes(path: str, body: bytes, extra: bytes = b"") -> bytes:
    head = f"POST {path} HTTP/1.1\r\nhost: [::1]\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
    return head.encode() + extra + b"\r\n" + body


def stalled_upload(port: int, sent: int, declared: int = 8 << 20, source: str = "127.0.0.1") -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=60, source_address=(source, 0))
    head = (
        f"POST /embed HTTP/1.1\r\nhost: [::1]\r\ncontent-type: application/json\r\ncontent-length: {declared}\r\n\r\n"
    )
    sock.sendall(head.encode() + b"x" * sent)
    return sock


def log_size(log: Path) -> int:
    return log.stat().st_size if log.exists() else 0


def answered(sock: socket.socket) -> str:
    """The status of what the server sent on a connection never read (peeked), or why there is none."""
    timeout = sock.gettimeout()
    sock.settimeout(0)  # a socket with a timeout waits for data before it peeks, MSG_DONTWAIT or not
    try:
        got = sock.recv(12, socket.MSG_PEEK)
    except BlockingIOError:
        return "nothing yet"
    except OSError as err:
        return type(err).__name__
    finally:
        sock.settimeout(timeout)
    return got[9:12].decode() if got else "closed"


@dataclass
class Served:
    """A server of a row's own: its URL, port and process id."""

    url: str
    port: int
    pid: int


def on_server(measure: Callable[[Served], str | None], **settings: str) -> Callable[[Path, Path], str | None]:
    """A row measured on a server of its own, the tree's code with the default limits (but `settings`)."""

    def row(model: Path, tree: Path) -> str | None:
        server, url, port = start_server(model, root=tree, settings=settings or None)
        try:
            return measure(Served(url, port, server.pid))
        finally:
            server.terminate()
            server.wait(timeout=60)

    return row


def run_rows(
    rows: dict[str, Row], model: Path, after: Path, names: list[str], before: Path | None = None,
    before_model: Path | None = None,
) -> None:  # fmt: skip
    """Each row of `names` against the code of `after`; with `before`, against it first and then `after`, back to
    back, each time with the CPU line; `before_model`: the export the before tree's elmo-export makes, else
    `model` for both."""
    trees = [("before", before), ("after", after)] if before is not None else [("", after)]
    print(f"{'before = ' + str(before) + ', ' if before else ''}the code of {after}; {cpu_line()}", flush=True)
    for row in names:
        title, measure = rows[row]
        for label, tree in trees:
            used = before_model if (label == "before" and before_model is not None) else model
            print(f"{row} ({title}){' ' + label if label else ''}:", flush=True)
            figures = measure(used, tree)  # None: the row printed its figures itself
            if figures:
                print(f"  {figures}", flush=True)
            print(f"  [{cpu_line()}]", flush=True)
