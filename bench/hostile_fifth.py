"""The fifth round of hardening (issue 39), `python -m bench.hostile --rounds fifth --before DIR`: each row runs
against the code of `--before` (a checkout at the commit before the fixes) and then of this checkout, back to back
on the same machine, and prints both figures with the CPU's flags and the load.

18. bodies that parse for seconds: 8 MB of 2.8 M empty lists, of one-token sentences, of `weights`, a /tokenize
    body and a /v1/embeddings `input` of 2 M strings: the time to the answer, the slowest /health/live meanwhile
    (polled every 20 ms) and the server's RSS growth (goal: liveness < 0.1 s, RSS a small multiple of the body).
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from bench.common import start_server

JSON = {"content-type": "application/json"}
EIGHT_MB = 8 << 20


def cpu_line() -> str:
    flags = re.search(r"^flags\s*:(.*)$", Path("/proc/cpuinfo").read_text(), re.M)
    wanted = ("avx", "avx2", "fma", "avx512f", "avx512_vnni", "amx_tile")
    have = [f for f in wanted if flags and f in flags.group(1).split()]
    return f"{os.cpu_count()} cores, flags {' '.join(have) or 'none of avx/avx2/avx512'}, load {os.getloadavg()[0]:.1f}"


def both(before: Path, after: Path, row: Callable[[Path], str], name: str) -> None:
    """`row` measured against the before tree and then the after tree, one line each."""
    for label, tree in (("before", before), ("after", after)):
        print(f"{name} {label}: {row(tree)}  [{cpu_line()}]", flush=True)


def _filled(head: bytes, item: bytes, tail: bytes, size: int = EIGHT_MB - 64) -> bytes:
    return head + item * ((size - len(head) - len(tail)) // len(item)) + item.rstrip(b",") + tail


PARSE_BODIES = {
    "empty lists": ("/embed", lambda: _filled(b'{"sentences": [', b"[],", b"]}")),
    "one-token sentences": ("/embed", lambda: _filled(b'{"sentences": [', b'["a"],', b"]}")),
    "weights": ("/embed", lambda: _filled(b'{"sentences": [["a"]], "weights": [', b"0.5,", b"]}")),
    "/tokenize": ("/tokenize", lambda: _filled(b'{"sentences": [', b'["a"],', b"]}")),
    "/v1 input": ("/v1/embeddings", lambda: _filled(b'{"input": [', b'"a",', b"]}")),
}


def parse_on_loop(model: Path, tree: Path) -> str:
    from bench.hostile import Liveness, PeakRss

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


ROWS = {"parse": ("18. bodies parsed on the event loop", parse_on_loop)}


def fifth_round(model: Path, before: Path, after: Path, rows: list[str]) -> None:
    print(f"fifth round: before = {before}, after = {after}; {cpu_line()}")
    for row in rows:
        name, measure = ROWS[row]
        both(before, after, lambda tree, measure=measure: measure(model, tree), name)


if __name__ == "__main__":
    import argparse

    from service.settings import DEFAULT_MODEL_DIR

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL_DIR)
    parser.add_argument("--before", type=Path, required=True, help="a checkout at the commit before the fixes")
    parser.add_argument("--rows", default=",".join(ROWS))
    args = parser.parse_args()
    fifth_round(args.model, args.before, Path(__file__).resolve().parents[1], args.rows.split(","))
