"""Signals: a second SIGTERM or SIGINT while the engine computes, and SIGHUP with requests in flight."""

from __future__ import annotations

import signal
import subprocess
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import httpx

from bench.common import start_server
from bench.hostile.parts import Row


def _busy(model: Path, tree: Path, log: Path, requests: int):
    """A server computing `requests` requests of six 1,000-token sentences (one engine batch each)."""
    settings = {"ELMO_BATCH_TOKENS": "1002", "ELMO_DRAIN_S": "30", "ELMO_LOG_LEVEL": "info"}
    server, url, _ = start_server(model, root=tree, settings=settings, log=log)
    body = {"sentences": [[f"w{j % 40}" for j in range(999)] + [f"s{k}"] for k in range(6)], "encoding": "base64"}
    results: list = []

    def post() -> None:
        try:
            results.append(httpx.post(f"{url}/embed", json=body, timeout=120).status_code)
        except httpx.TransportError as err:
            results.append(type(err).__name__)

    threads = [threading.Thread(target=post) for _ in range(requests)]
    for thread in threads:
        thread.start()
    time.sleep(1.5)  # the engine is on them
    return server, threads, results


def _exit_status(server: subprocess.Popen) -> int:
    try:
        return server.wait(timeout=60)
    except subprocess.TimeoutExpired:
        server.kill()
        return server.wait()


def stop_signals(model: Path, tree: Path) -> str:
    """A second SIGTERM or SIGINT under load, and SIGHUP with requests in flight."""
    figures = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        log = Path(tempfile.mkdtemp()) / "server.log"
        server, threads, results = _busy(model, tree, log, 4)
        server.send_signal(sig)
        time.sleep(0.3)
        server.send_signal(sig)
        start = time.monotonic()
        status = _exit_status(server)
        seconds = time.monotonic() - start
        for thread in threads:
            thread.join()
        text = log.read_text(errors="replace")
        figures.append(f"a second {sig.name}: exit {status} after {seconds:.2f} s, the requests "
                       f"{dict(Counter(results))}, traceback {'Traceback' in text}, abort "
                       f"{'terminate called' in text}, a line saying so {'second stop signal' in text}")  # fmt: skip
    log = Path(tempfile.mkdtemp()) / "server.log"
    server, threads, results = _busy(model, tree, log, 2)
    server.send_signal(signal.SIGHUP)
    for thread in threads:
        thread.join()
    status = _exit_status(server)
    drained = "draining" in log.read_text(errors="replace")
    figures.append(f"SIGHUP with two requests in flight: {dict(Counter(results))}, exit {status}, drained {drained}")
    return "; ".join(figures)


ROWS: dict[str, Row] = {
    "signals": ("a second stop signal, and SIGHUP", stop_signals),
}
