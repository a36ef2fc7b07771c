"""Floods: one address's hundreds of connections on /embed (mixed requests, or texts that Moses tokenizes), its
idle connections at a 1024 open-files limit, its long texts in line for the tokenizing threads, and everything at
once (stalled uploads, punctuation bombs, maximal answers, idle connections) beside normal clients."""

from __future__ import annotations

import asyncio
import socket
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx
import orjson

from bench.common import percentiles, start_server
from bench.hostile.answers import maximal_request, normal_clients
from bench.hostile.parts import BOMB, JSON, OPTIONS, SMALL, PeakRss, Probe, Row, on_server, post_bytes, stalled_upload

SMALL_TEXT = orjson.dumps({"sentences": ["The bank of the river."], "pooling": "mean"})


WORDS = ["the", "bank", "of", "a", "river", "is", "where", "the", "water", "meets", "the", "land"]


def _tokens(n: int, k: int) -> list[str]:
    return [WORDS[(k + j) % len(WORDS)] for j in range(n)]


def _text(n: int, k: int) -> str:
    """`n` words, a comma every 9th and a full stop every 25th, as prose has (Moses splits both off)."""
    words = [w + ("." if j % 25 == 24 else "," if j % 9 == 8 else "") for j, w in enumerate(_tokens(n, k))]
    return " ".join(words) + "."


# The mixed flood: mostly tokens, one request in six a text.
MIXED_BODIES = [
    SMALL,
    orjson.dumps({"sentences": [_tokens(20, k) for k in range(4)], "pooling": "mean"}),
    orjson.dumps({"sentences": [_tokens(20, k) for k in range(16)]}),
    orjson.dumps({"sentences": [_text(40, k) for k in range(4)], "pooling": "mean"}),
    orjson.dumps({"sentences": [_tokens(60, k) for k in range(32)], "encoding": "base64"}),
    orjson.dumps({"sentences": [_tokens(126, k) for k in range(8)], "output": "layers"}),
]


# The text flood: 4 texts of 150 words, pooled, again and again.
TEXT_BODIES = [orjson.dumps({"sentences": [_text(150, k) for k in range(4)], "pooling": "mean"})]


def _flood(port: int, address: str, connections: int, seconds: float, results, bodies: list[bytes]) -> None:
    """A process of its own: `connections` keep-alive connections from `address`, each sending `bodies` in turn
    one after the other with no pause (wrk's way), reading every answer whole; their statuses."""
    statuses: Counter = Counter()

    async def one(k: int) -> None:
        end = time.monotonic() + seconds
        reader = writer = None
        i = k
        while time.monotonic() < end:
            try:
                if writer is None:
                    reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(address, 0))
                body = bodies[i % len(bodies)]
                writer.write(post_bytes("/embed", body))
                headers = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 60)
                length = int(headers.lower().split(b"content-length:")[1].split(b"\r\n")[0])
                await asyncio.wait_for(reader.readexactly(length), 60)
                statuses[int(headers[9:12])] += 1
                if b"connection: close" in headers.lower():
                    writer.close()
                    writer = None
            except (OSError, asyncio.IncompleteReadError, asyncio.TimeoutError, IndexError, ValueError) as err:
                statuses[type(err).__name__] += 1
                if writer is not None:
                    writer.close()
                writer = None
                await asyncio.sleep(0.1)
            i += 1
        if writer is not None:
            writer.close()

    async def all_of_them() -> None:
        await asyncio.gather(*(one(k) for k in range(connections)))

    asyncio.run(all_of_them())
    results.update(statuses)


def overload_flood(model: Path, tree: Path, connections: int = 300, seconds: float = 30, texts: bool = False) -> str:
    """A flood of mixed requests from one address, beside small requests from four others and the liveness probe.
    `texts`: the flood is TEXT_BODIES and the others' requests send a text too (Moses tokenizes them), and then,
    the flood over, one /tokenize of texts that fit once truncated."""
    import multiprocessing

    server, url, port = start_server(model, root=tree)
    try:
        results = multiprocessing.Manager().dict()
        bodies = TEXT_BODIES if texts else MIXED_BODIES
        flood = multiprocessing.Process(target=_flood, args=(port, "127.0.0.2", connections, seconds, results, bodies))
        small = SMALL_TEXT if texts else SMALL
        probes = [Probe(url, f"127.0.0.{k}", path="/embed", body=small) for k in (3, 4, 5, 6)]
        with PeakRss(server.pid) as rss, Probe(url, "127.0.0.9", every=0.1) as live:
            flood.start()
            time.sleep(2)  # the flood under way
            for probe in probes:
                probe.thread.start()
            time.sleep(seconds - 4)
            for probe in probes:
                probe.stop.set()
                probe.thread.join()
            flood.join()
        others = Probe(url, "")
        for probe in probes:
            others.seconds += probe.seconds
            others.outcomes += probe.outcomes
        flooded = dict(results)
        answered_per_s = {status: round(n / seconds) for status, n in flooded.items()}
        what = "4 texts of 150 words (pooled)" if texts else "mixed requests"
        print(f"{connections} connections from one address flooding /embed with {what} for "
              f"{seconds:.0f} s (per second: {answered_per_s}): 4 other addresses' small POSTs every 0.2 s: "
              f"{others.figures()}; /health/live every 0.1 s: {live.figures()}; RSS +{rss.grown_mb:.0f} MB "
              "(goal: >= 98% 200, p99 < 1.5 s, liveness < 0.5 s)")  # fmt: skip
        return fitting_truncate(url) if texts else ""
    finally:
        server.terminate()
        server.wait(timeout=60)


def overload_floods(model: Path, tree: Path) -> None:
    for connections in (300, 1000):
        overload_flood(model, tree, connections)


def text_flood(model: Path, tree: Path) -> str:
    """300 connections from one address flooding /embed with 4 texts of 150 words, pooled; then the fitting
    truncate."""
    return overload_flood(model, tree, 300, texts=True)


def fitting_truncate(url: str, texts: int = 62, words: int = 15_900) -> str:
    """One /tokenize of `texts` texts of `words` words with truncate: each is cut to the limit, and the cut ones
    fill the queue's 65,536 tokens but fit (62 x 1,016 words read)."""
    # words and a full stop, no commas: the upper bound on tokens (words and punctuation) stays under 16,000
    sentences = [" ".join(_tokens(words, k)) + "." for k in range(texts)]
    body = orjson.dumps({"sentences": sentences, "truncate": True})
    with httpx.Client(base_url=url, timeout=300) as c:
        times = []
        for _ in range(3):
            start = time.perf_counter()
            status = c.post("/tokenize", content=body, headers=JSON).status_code
            times.append(time.perf_counter() - start)
    return (f"truncate, {texts} texts of {words:,} words ({len(body) / 1e6:.1f} MB) on /tokenize, the flood "
            f"over: {status} in {min(times):.2f} s best of 3, {max(times):.2f} s worst (goal: < 0.5 s)")  # fmt: skip


def _idle_holder(port: int, address: str, count: int, seconds: float, opened: list) -> None:
    """`count` connections from `address` that send nothing, each opened again as soon as the server closes it
    (a process of its own: the probes' timing must not share its interpreter)."""
    import selectors

    chooser = selectors.DefaultSelector()
    made = 0

    def open_one() -> None:
        nonlocal made
        sock = socket.socket()
        sock.setblocking(False)
        try:
            sock.bind((address, 0))
            sock.connect_ex(("127.0.0.1", port))
            chooser.register(sock, selectors.EVENT_READ)
            made += 1
        except OSError:
            sock.close()

    for _ in range(count):
        open_one()
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for key, _ in chooser.select(timeout=0.2):
            chooser.unregister(key.fileobj)
            key.fileobj.close()
            open_one()
        while len(chooser.get_map()) < count and time.monotonic() < end:
            before = made
            open_one()
            if made == before:
                time.sleep(0.05)
                break
    opened.append(made)


def idle_connections_at_1024(model: Path, tree: Path, count: int = 1100, requests: int = 150) -> None:
    """A server whose open-files limit is 1024 (soft and hard), 1,100 idle connections from one address,
    and requests from three others."""
    import multiprocessing

    log = Path(tempfile.mkdtemp()) / "server.log"
    server, url, port = start_server(model, root=tree, open_files=1024, log=log, settings={"ELMO_LOG_LEVEL": "info"})
    try:
        seconds = requests / 3 * 0.2 + 5
        opened = multiprocessing.Manager().list()
        holder = multiprocessing.Process(target=_idle_holder, args=(port, "127.0.0.2", count, seconds + 5, opened))
        holder.start()
        time.sleep(3)
        probes = [Probe(url, f"127.0.0.{k}", path="/embed", body=SMALL) for k in (3, 4, 5)]
        for probe in probes:
            probe.thread.start()
        time.sleep(seconds)
        for probe in probes:
            probe.stop.set()
            probe.thread.join()
        holder.join()
        outcomes = sum((probe.outcomes for probe in probes), Counter())
        latencies = [t for probe in probes for t in probe.seconds]
        share = outcomes[200] / max(1, sum(outcomes.values()))
        text = log.read_text(errors="replace")
        lines = [line for line in text.splitlines() if "connection" in line.lower() or "open files" in line.lower()]
        print(f"{count} idle connections from one address (kept open, {opened[0] if opened else '?'} opened) at "
              f"a 1024 open-files limit: {sum(outcomes.values())} small POSTs from 3 other addresses, each on a new "
              f"connection: {share:.1%} answered 200 ({dict(outcomes)}), p99 "
              f"{percentiles(latencies)['p99']:.3f} s (goal: >= 95%); the log: "
              f"{([*lines[:3], '...'] if len(lines) > 3 else lines) or 'nothing about it'}")  # fmt: skip
    finally:
        server.terminate()
        server.wait(timeout=60)


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


async def mixed_load(url: str, port: int, clients: int, seconds: float) -> None:
    body, _ = maximal_request(url)
    stop = asyncio.Event()
    hostile: Counter = Counter()
    normal = asyncio.ensure_future(normal_clients(url, clients, stop))

    async def stalls():  # a stalled upload of 4 MiB every 2 s; each is cut off 10 s later
        socks = []
        while not stop.is_set():
            socks.append(await asyncio.to_thread(stalled_upload, port, 4 << 20))
            hostile["stalled upload"] += 1
            await asyncio.sleep(2)
        for sock in socks:
            sock.close()

    async def idle():  # 50 connections that send nothing, opened again as the server closes them
        while not stop.is_set():
            socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(50)]
            hostile["idle connection"] += 50
            await asyncio.sleep(5)
            for sock in socks:
                sock.close()

    async def repeat(kind: str, payload: bytes, pause: float):
        async with httpx.AsyncClient(base_url=url, timeout=120) as http:
            while not stop.is_set():
                status = (await http.post("/embed", content=payload, headers=JSON)).status_code
                hostile[f"{kind} {status}"] += 1
                await asyncio.sleep(pause)

    tasks = [asyncio.ensure_future(t) for t in (stalls(), idle(), repeat("bomb", BOMB, 0.5),
                                                repeat("maximal answer", body, 0.0))]  # fmt: skip
    await asyncio.sleep(seconds)
    stop.set()
    await asyncio.gather(*tasks)
    latencies, statuses = await normal
    p = percentiles(latencies)
    errors = sum(n for s, n in statuses.items() if s != 200)
    print(
        f"mixed hostile load for {seconds:.0f} s ({dict(hostile)}): {clients} normal clients' p50 "
        f"{p['p50']:.3f} s, p99 {p['p99']:.3f} s over {len(latencies)} requests, {errors} errors {dict(statuses)}"
    )


ROWS: dict[str, Row] = {
    "flood": ("300, then 1,000, connections from one address flooding /embed", overload_floods),
    "text-flood": ("300 connections from one address flooding /embed with texts, and a fitting truncate", text_flood),
    "descriptors": ("1,100 idle connections from one address at a 1024 open-files limit", idle_connections_at_1024),
    "tokenize-turns": ("one address's long texts beside another's", tokenizing_turns),
    "mixed": ("stalled uploads, bombs, maximal answers and idle connections at once", on_server(
        lambda s: asyncio.run(mixed_load(s.url, s.port, OPTIONS["clients"], OPTIONS["seconds"])))),
}  # fmt: skip
