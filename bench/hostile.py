"""Hostile clients beside normal ones, against one elmo-serve with the default limits (not part of the tests: it
takes a few minutes). It prints the figures of the second round of hardening, then those of a mixed load:

    .venv/bin/python -m bench.hostile [--model DIR] [--seconds 30] [--clients 4]

1. stalled uploads: nine POSTs declare 8 MiB and send 7 MiB, a tenth 1 MiB, then all stop, holding the whole
   in-flight body budget; how long until a small POST is answered 200 again (goal: within 15 s);
2. a punctuation bomb, `{"sentences": ["a," * 4000000]}`: the time to its 4xx (goal: < 0.2 s);
3. eight of them at once: the server's peak resident memory (VmHWM; goal: < 1 GB);
4. a small request's latency while maximal answers are served: requests of 126-token sentences, per layer, as
   many as fit the answer limit, one after the other, beside `--clients` clients sending small requests
   (goal: p99 <= 0.5 s);
5. a mixed hostile load for `--seconds`: stalled uploads, punctuation bombs, maximal answers and idle
   connections, beside `--clients` normal clients; their p50, p99 and errors.

By default it serves the embedded default model (build/models/default, exported by `make serve`) and starts
its own elmo-serve on 127.0.0.1 with one ONNX Runtime thread.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import numpy as np
import orjson

from bench.common import ROOT, percentiles, start_server

DEFAULT_MODEL = ROOT / "build" / "models" / "default"
SMALL = orjson.dumps({"sentences": [["The", "bank", "of", "the", "river", "."]], "pooling": "mean"})
BOMB = orjson.dumps({"sentences": ["a," * 4_000_000]})
JSON = {"content-type": "application/json"}


def memory(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(field)


def stalled_upload(port: int, sent: int, declared: int = 8 << 20) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=60)
    head = f"POST /embed HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {declared}\r\n\r\n"
    sock.sendall(head.encode() + b"x" * sent)
    return sock


def stalled_uploads(port: int, url: str) -> float:
    socks = [stalled_upload(port, 7 << 20) for _ in range(9)] + [stalled_upload(port, (1 << 20) - 8)]
    stall = time.monotonic()
    with httpx.Client(base_url=url, timeout=30) as client:
        statuses = Counter()
        while (status := client.post("/embed", content=SMALL, headers=JSON).status_code) != 200 or not statuses:
            statuses[status] += 1
            if time.monotonic() > stall + 60:
                raise SystemExit("still refused 60 s after the stall")
            time.sleep(0.1)
    seconds = time.monotonic() - stall
    for sock in socks:
        sock.close()
    print(f"1. stalled uploads: a small POST answered 200 {seconds:.1f} s after the stall "
          f"(refused meanwhile: {dict(statuses)}; goal: within 15 s)")  # fmt: skip
    return seconds


def punctuation_bombs(url: str, pid: int) -> None:
    times = []
    with httpx.Client(base_url=url, timeout=120) as client:
        for _ in range(5):
            start = time.monotonic()
            status = client.post("/embed", content=BOMB, headers=JSON).status_code
            times.append(time.monotonic() - start)
            assert 400 <= status < 500, status
    print(f"2. punctuation bomb ('a,' * 4000000, 8 MB): its {status} in {np.median(times):.3f} s median, "
          f"{max(times):.3f} s at most, of 5 (goal: < 0.2 s)")  # fmt: skip
    before = memory(pid, "VmHWM")

    def one(_):
        return httpx.post(f"{url}/embed", content=BOMB, headers=JSON, timeout=120).status_code

    start = time.monotonic()
    threads = [threading.Thread(target=one, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(f"3. eight at once: all answered in {time.monotonic() - start:.2f} s; peak RSS {before / 1e6:.0f} MB "
          f"before, {memory(pid, 'VmHWM') / 1e6:.0f} MB after (goal: < 1000 MB)")  # fmt: skip


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
    print(f"4. maximal answers ({n} sentences of 126 tokens, per layer, {np.mean(sizes) / 2**20:.0f} MiB of JSON, "
          f"{np.mean(seconds):.2f} s each, {repeats} in a row): {clients} small clients' latency p50 {p['p50']:.3f} s, "
          f"p99 {p['p99']:.3f} s, max {max(latencies):.3f} s over {len(latencies)} requests; "
          f"statuses {dict(statuses)} (goal: p99 <= 0.5 s)")  # fmt: skip


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
        f"5. mixed hostile load for {seconds:.0f} s ({dict(hostile)}): {clients} normal clients' p50 "
        f"{p['p50']:.3f} s, p99 {p['p99']:.3f} s over {len(latencies)} requests, {errors} errors {dict(statuses)}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL, help="exported model (default: the embedded one)")
    parser.add_argument("--seconds", type=float, default=30, help="length of the mixed load")
    parser.add_argument("--clients", type=int, default=4, help="normal clients sending small requests")
    args = parser.parse_args()
    if not (args.model / "manifest.json").exists():
        raise SystemExit(f"no model at {args.model}: run `make serve` once (it exports it), or pass --model")
    server, url, port = start_server(args.model)
    try:
        info = httpx.get(f"{url}/info").json()
        print(f"model: {args.model} (dim {info['dim']}, {info['num_layers']} layers); the default limits")
        stalled_uploads(port, url)
        punctuation_bombs(url, server.pid)
        asyncio.run(beside_maximal_answers(url, args.clients))
        asyncio.run(mixed_load(url, port, args.clients, args.seconds))
        ready = httpx.get(f"{url}/health/ready").status_code
        print(f"afterwards: /health/ready {ready}, peak RSS {memory(server.pid, 'VmHWM') / 1e6:.0f} MB")
        return 0
    finally:
        server.terminate()
        server.wait(timeout=60)


if __name__ == "__main__":
    sys.exit(main())
