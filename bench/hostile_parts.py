"""What the rows of bench/hostile.py and bench/hostile_fifth.py share: the server's memory, the CPU line printed
beside every figure, the liveness and RSS samplers, and the runner of rows measured before and after a fix, back to
back (a row: a name and a function of (model, tree) that serves the tree's code and returns its figures)."""

from __future__ import annotations

import os
import re
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx

Row = tuple[str, Callable[[Path, Path], str]]


def memory(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(field)


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


def before_and_after(
    rows: dict[str, Row], model: Path, before: Path, after: Path, names: list[str], before_model: Path | None = None
) -> None:
    """Each row of `names` against the code of `before` and then of `after`, its figures printed with the CPU line;
    `before_model`: the export the before tree's elmo-export makes (a row whose figure depends on the export's
    canaries needs one), else `model` for both."""
    print(f"before = {before}, after = {after}; {cpu_line()}")
    for row in names:
        name, measure = rows[row]
        for label, tree in (("before", before), ("after", after)):
            used = before_model if (label == "before" and before_model is not None) else model
            print(f"{name} {label}: {measure(used, tree)}  [{cpu_line()}]", flush=True)
