"""The rows of the fifth round of hardening (issue 39), run by `python -m bench.hostile --rounds fifth --before DIR
[--before-model EXPORT] [--rows parse,tamper,...]` (bench/hostile.py's registry, bench/hostile_parts.py's runner):
each row runs against the code of `--before` (a checkout at the commit before the fixes) and then of this
checkout, back to back on the same machine, and prints both figures with the CPU's flags and the load.

18. bodies that parse for seconds: 8 MB of 2.8 M empty lists, of one-token sentences, of `weights`, a /tokenize
    body and a /v1/embeddings `input` of 2 M strings: the time to the answer, the slowest /health/live meanwhile
    (polled every 20 ms) and the server's RSS growth (goal: liveness < 0.1 s, RSS a small multiple of the body);
19. model.onnx with the char-embedding row of 'Z' changed, its manifest's sum made to match, and left as exported:
    served or refused (goal: refused, by the canaries and by the sum);
20. one request whose path holds CR, LF and ESC, with the text access log on: raw control bytes in the log
    (goal: none);
21. four connections from one address looping 8 texts of 200,000 characters on /tokenize (one tokenizing thread),
    beside another address's small texts: their p50, p99, max (goal: p99 < 1 s); then 20 texts of 8,400 words
    with truncate: the time to the answer;
22. ELMO_FORWARDED_ALLOW_IPS=0.0.0.0/0 and ::/0, ELMO_API_KEYS=",,,", ELMO_METRICS_PORT equal to the port: exit
    status and time (goal: refused before loading); If-None-Match with the ETag, a weak one and '*' (goal: 304).
23. 20 connections answered 401 (API keys on) before their 1,000-byte bodies came, each then sending one more
    byte: how many are still open after 30 s of silence (keep-alive 5 s, head timeout 10 s; goal: none);
24. a 7 MB body in 64 KB chunks, then in 1-byte chunks: the answer, how long it took and the server's CPU for each
    (goal: < 3x the CPU of the 64 KB chunks, or refused early);
25. a second SIGTERM, and a second SIGINT, 0.3 s after the first, while the engine computes four requests of six
    1,000-token sentences: the exit status, how long it took, a traceback or an abort in the log; and SIGHUP with
    two such requests in flight: their answers and the exit status (goal: a second signal stops at once with exit
    0 and one line, SIGHUP drains like SIGTERM).
26. the metrics port (ELMO_METRICS_PORT): a small POST's p50 and p99 on the main port alone; beside 1,000
    connections to the metrics port from 100 addresses, half sending 1 MB of header lines, half a byte a second
    (the server's RSS growth, how many it closed); beside eight scrapers looping on it (goal: RSS < +100 MB, the
    main port's p99 within 1.5x of alone).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import orjson

from bench.common import start_server
from bench.hostile_parts import Liveness, PeakRss

JSON = {"content-type": "application/json"}
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


def tampered_graph(model: Path, tree: Path, before_model: Path | None = None) -> str:
    """A copy of the export whose model.onnx has the char-embedding row of 'Z' changed, its manifest's sum made to
    match (as one who changes a graph could), and one with the sum left as exported: served or refused."""
    import json
    import shutil
    import subprocess
    import sys
    import tempfile

    import onnx
    from onnx import numpy_helper

    from service.manifest import sha256

    figures = []
    with tempfile.TemporaryDirectory() as tmp:
        for resum in (True, False):
            folder = Path(tmp) / f"m{resum}"
            shutil.copytree(model, folder)
            graph = onnx.load(str(folder / "model.onnx"))
            table = next(t for t in graph.graph.initializer if t.name.startswith("char_embed"))
            rows = numpy_helper.to_array(table).copy()
            rows[ord("Z") + 1] += 0.5
            table.CopyFrom(numpy_helper.from_array(rows, table.name))
            onnx.save(graph, str(folder / "model.onnx"))
            manifest = json.loads((folder / "manifest.json").read_text())
            if resum:
                manifest.setdefault("files", {})["model.onnx"] = sha256(folder / "model.onnx")
            (folder / "manifest.json").write_text(json.dumps(manifest))
            env = {k: v for k, v in os.environ.items() if not k.startswith("ELMO_")} | {"ELMO_PROVIDER": "cpu"}
            start = time.perf_counter()
            proc = subprocess.Popen(
                [sys.executable, "-c", "import sys; from service.cli import serve_main; sys.exit(serve_main())",
                 "--model", str(folder), "--port", "0"],
                cwd=tree, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            )  # fmt: skip
            try:
                out, _ = proc.communicate(timeout=30)
                verdict = f"refused in {time.perf_counter() - start:.1f} s ({_why(out)})"
            except subprocess.TimeoutExpired:
                proc.terminate()
                out, _ = proc.communicate(timeout=30)
                verdict = "SERVED" + (f" ({_why(out)})" if "canaries" in out else "")
            figures.append(f"{'sum made to match' if resum else 'sum as exported'}: {verdict}")
    return "; ".join(figures)


def _why(out: str) -> str:
    for marker in ("sha256", "records no sha256", "canaries"):
        for line in out.splitlines():
            if marker in line:
                return line.split(": ", 1)[-1][:150]
    return out.strip().splitlines()[-1][:150] if out.strip() else "no output"


def forged_log(model: Path, tree: Path) -> str:
    """One request whose path holds CR, LF and ESC, with ELMO_ACCESS_LOG=true (text): raw control bytes in the log."""
    import socket
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "server.log"
        settings = {"ELMO_ACCESS_LOG": "true", "ELMO_LOG_LEVEL": "info"}
        server, _, port = start_server(model, root=tree, log=log, settings=settings)
        try:
            forged = b"/x%0D%0A2026-11-28%2012:00:00,000%20INFO%20elmo.access:%20GET%20/embed%1B[2K%1B[1A"
            with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
                sock.sendall(b"GET " + forged + b" HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
                while sock.recv(65536):
                    pass
            time.sleep(0.5)
        finally:
            server.terminate()
            server.wait(timeout=60)
        text = log.read_bytes()
    raw = sum(text.count(c) for c in (b"\r", b"\x1b"))
    line = next((x for x in text.split(b"\n") if b"elmo.access" in x and b"404" in x), b"")
    return f"raw CR/ESC bytes in the log: {raw}; the access line: {line[24:120]!r}"


LONG_TEXT = " ".join(["x" * 199] * 1000)  # 200,000 characters, 1,000 tokens


def tokenizing_turns(model: Path, tree: Path, seconds: float = 12) -> str:
    """Four connections from 127.0.0.2 looping 8 texts of 200,000 characters on /tokenize (one tokenizing thread),
    beside small text requests from 127.0.0.3 every 0.1 s; then 20 texts of 8,400 words with truncate."""
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np

    server, url, _ = start_server(model, root=tree, settings={"ELMO_TOKENIZE_THREADS": "1"})
    try:
        body = orjson.dumps({"sentences": [LONG_TEXT] * 8})
        stop, times = [False], []

        def attacker(_):
            transport = httpx.HTTPTransport(local_address="127.0.0.2")
            with httpx.Client(base_url=url, transport=transport, timeout=300) as c:
                while not stop[0]:
                    c.post("/tokenize", content=body, headers=JSON)

        with ThreadPoolExecutor(4) as pool:
            attacks = [pool.submit(attacker, k) for k in range(4)]
            time.sleep(1.0)
            transport = httpx.HTTPTransport(local_address="127.0.0.3")
            with httpx.Client(base_url=url, transport=transport, timeout=300) as c:
                end = time.perf_counter() + seconds
                while time.perf_counter() < end:
                    start = time.perf_counter()
                    c.post("/tokenize", json={"sentences": ["She went to the bank."]})
                    times.append(time.perf_counter() - start)
                    time.sleep(0.1)
            stop[0] = True
            for attack in attacks:
                attack.result()
        words = ("Dr. Smith went to the U.S. in 1999 , e.g. to see Mr. Jones . " * 600).split()
        texts = [" ".join(words[k:]) for k in range(20)]
        with httpx.Client(base_url=url, timeout=300) as c:
            start = time.perf_counter()
            status = c.post("/tokenize", json={"sentences": texts, "truncate": True}).status_code
            took = time.perf_counter() - start
    finally:
        server.terminate()
        server.wait(timeout=60)
    p50, p99 = np.percentile(times, [50, 99])
    return (f"other address's small texts: {len(times)} requests, p50 {p50 * 1e3:.0f} ms, p99 {p99 * 1e3:.0f} ms, "
            f"max {max(times) * 1e3:.0f} ms; truncate, 20 texts of 8,400 words: {status} in {took:.2f} s")  # fmt: skip


def settings_and_etags(model: Path, tree: Path) -> str:
    import socket
    import subprocess
    import sys

    figures = []
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cases = {
        "0.0.0.0/0": {"ELMO_FORWARDED_ALLOW_IPS": "0.0.0.0/0"},
        "::/0": {"ELMO_FORWARDED_ALLOW_IPS": "::/0"},
        "keys ',,,'": {"ELMO_API_KEYS": ",,,"},
        "metrics port = port": {"ELMO_METRICS_PORT": str(port)},
    }
    for name, settings in cases.items():
        env = {k: v for k, v in os.environ.items() if not k.startswith("ELMO_")} | {"ELMO_PROVIDER": "cpu", **settings}
        start = time.perf_counter()
        proc = subprocess.Popen(
            [sys.executable, "-c", "import sys; from service.cli import serve_main; sys.exit(serve_main())",
             "--model", str(model), "--port", str(port)],
            cwd=tree, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        try:
            code = proc.wait(timeout=20)
            figures.append(f"{name}: exit {code} in {time.perf_counter() - start:.1f} s")
        except subprocess.TimeoutExpired:
            proc.terminate()
            proc.wait(timeout=60)
            figures.append(f"{name}: SERVED (still running after 20 s)")
    server, url, _ = start_server(model, root=tree)
    try:
        etag = httpx.get(f"{url}/openapi.json").headers["etag"]
        for tag in (etag, f"W/{etag}", "*"):
            status = httpx.get(f"{url}/openapi.json", headers={"if-none-match": tag}).status_code
            figures.append(f"If-None-Match {tag[:6]}...: {status}")
    finally:
        server.terminate()
        server.wait(timeout=60)
    return "; ".join(figures)


def early_answers_then_a_byte(model: Path, tree: Path, count: int = 20, silence_s: float = 30) -> str:
    """Connections answered 401 before their bodies came, then sent one more byte of the body."""
    server, _, port = start_server(model, root=tree, settings={"ELMO_API_KEYS": "bench-key"})
    try:
        head = b"POST /embed HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 1000\r\n\r\n{"
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


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def _chunked(port: int, body: bytes, size: int) -> tuple[str, float]:
    """`body` sent chunked, in chunks of `size` bytes: the answer's status and the seconds to it."""
    parts = (body[k : k + size] for k in range(0, len(body), size))
    chunks = b"".join(b"%x\r\n%s\r\n" % (len(part), part) for part in parts)
    head = b"POST /embed HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n"
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
            before = _cpu_seconds(server.pid)
            status, seconds = _chunked(port, body, chunk)
            time.sleep(0.5)  # what the server still does with it
            figures.append((status, seconds, _cpu_seconds(server.pid) - before))
        (s64, t64, c64), (s1, t1, c1) = figures
        return (f"64 KB chunks: {s64} in {t64:.2f} s, {c64:.2f} s of server CPU; 1-byte chunks: {s1} in {t1:.2f} s, "
                f"{c1:.2f} s of server CPU ({c1 / max(c64, 0.01):.1f}x)")  # fmt: skip
    finally:
        server.terminate()
        server.wait(timeout=60)


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
    """Row 26: the main port's p99 alone; beside `count` slow or huge-header connections to the metrics port (the
    server's RSS growth, how many it closed); beside eight scrapers looping on it (scrapes a second)."""
    import multiprocessing

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        mport = sock.getsockname()[1]
    server, url, _ = start_server(model, root=tree, settings={"ELMO_METRICS_PORT": str(mport)})
    figures = []
    try:
        cpu = _cpu_seconds(server.pid)
        with MainPort(url) as alone:
            time.sleep(seconds)
        cpu = _cpu_seconds(server.pid) - cpu
        figures.append(f"alone: {alone.figures()}, server CPU {cpu:.1f} s in {seconds:g} s")
        # the attackers in processes of their own: their Python would otherwise slow the probe's (one GIL)
        spawn = multiprocessing.get_context("spawn")
        with spawn.Pool(1) as attacker:
            cpu = _cpu_seconds(server.pid)
            with PeakRss(server.pid) as rss, MainPort(url) as attacked:
                connected, closed = attacker.apply(_hostile_metrics_connections, (mport, count, attack_s))
            cpu = _cpu_seconds(server.pid) - cpu
            time.sleep(1)
            after = PeakRss(server.pid)
            figures.append(
                f"{count} slow or huge-header connections to the metrics port ({connected} connected, {closed} closed "
                f"by the server within {attack_s:g} s): RSS +{rss.grown_mb:.0f} MB at the peak, "
                f"+{(after.start - rss.start) / 1e6:.0f} MB once closed, server CPU {cpu:.1f} s, {attacked.figures()}"
            )
            cpu = _cpu_seconds(server.pid)
            with MainPort(url) as scraped:
                scrapes = attacker.apply(_scrapers, (mport, 8, seconds))
            cpu = _cpu_seconds(server.pid) - cpu
        figures.append(
            f"eight scrapers in a loop ({scrapes / seconds:.0f} scrapes/s, server CPU {cpu:.1f} s in {seconds:g} s "
            f"with the main port's requests): {scraped.figures()}"
        )
    finally:
        server.terminate()
        server.wait(timeout=60)
    return "; ".join(figures)


ROWS = {
    "parse": ("18. bodies parsed on the event loop", parse_on_loop),
    "tamper": ("19. model.onnx with the char row of 'Z' changed", tampered_graph),
    "log": ("20. a forged access-log line", forged_log),
    "tokenize": ("21. one address's long texts beside another's", tokenizing_turns),
    "settings": ("22. settings and If-None-Match", settings_and_etags),
    "early-answers": ("23. early answers, then one more byte", early_answers_then_a_byte),
    "tiny-chunks": ("24. a 7 MB body in 1-byte chunks", tiny_chunks),
    "signals": ("25. a second stop signal, and SIGHUP", stop_signals),
    "metrics-port": ("26. the metrics port: hostile connections and scrapers", metrics_port),
}
