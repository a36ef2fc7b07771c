"""Service throughput and latency under concurrency, against bulk elmo-embed, on one machine.

    .venv/bin/python -m bench.load [--clients 1,8,32,128] [--seconds 20] [--encoding float] [--model DIR]
        [--precision fp32|int8]

In one run, on the full-size published architecture (random weights) unless --model is given:
  1. bulk: one `elmo-embed` job over the fixture sentences (x20), tokens/s of its embedding phase;
  2. engine: the engine's own time for each fixture sentence alone (batch 1), in this process;
  3. a real `elmo-serve` process on 127.0.0.1, and for each concurrency N, N closed-loop clients each
     sending one-sentence POST /embed requests (the fixture sentences in turn) over a keep-alive connection
     for --seconds (a minimal client: the load generator shares the 2 cores with the server):
     tokens/s, requests/s, p50/p95/p99 latency, errors.
Bars: 32 clients reach >= 70% of the bulk tokens/s; a lone client's p50 <= 1.3x the engine's batch-1 time.
Around it all, the yardstick (bench/yardstick.py: ONNX Runtime's GEMM at the LSTM step's shape in the precision's
fp32 or int8, the CPU's flags), and the bulk and served tokens/s as fractions of the precision's ceiling.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import orjson

from bench.common import BUILD, ROOT, fixture_sentences, full_size_model, percentiles
from bench.yardstick import Yardstick
from model_export.options import BiLMOptions
from service.engine.session import Engine
from service.metrics import STAGES


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bulk_tokens_per_s(model: Path, sentences: list[list[str]], threads: int, precision: str = "fp32") -> float:
    path = BUILD / "load-bulk.txt"
    path.write_text("".join(" ".join(s) + "\n" for s in sentences))
    run = subprocess.run(
        [sys.executable, "-m", "service.cli", "--model", str(model), str(path), str(BUILD / "load-bulk.hdf5"),
         "--no-progress", "--threads", str(threads), "--precision", precision],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return float(re.search(r"\((\d+) tokens/s\)", run.stderr).group(1))


def engine_metrics(base: str) -> tuple[float, float]:
    """(batches, engine seconds) so far, from the server's /metrics (every model's together)."""
    text = httpx.get(f"{base}/metrics").text
    value = lambda name: sum(float(v) for v in re.findall(rf"^{name}(?:\{{[^}}]*\}})? (\S+)", text, re.M))  # noqa: E731
    return value("elmo_inference_seconds_count"), value("elmo_inference_seconds_sum")


def stage_metrics(base: str) -> dict[str, float]:
    """Seconds so far per stage of the server's embedding requests (elmo_stage_seconds), and `requests`: the
    /embed requests answered."""
    text = httpx.get(f"{base}/metrics").text
    stage = re.compile(r'^elmo_stage_seconds_sum\{stage="(\w+)"\} (\S+)', re.M)
    sums = {m.group(1): float(m.group(2)) for m in stage.finditer(text)}
    count = re.search(r'^elmo_request_seconds_count\{route="/embed"\} (\S+)', text, re.M)
    return {**sums, "requests": float(count.group(1)) if count else 0.0}


def stage_line(before: dict[str, float], after: dict[str, float]) -> str:
    """The server's time per request by stage between two readings: CPU ms, and the engine's wall ms."""
    requests = max(1.0, after["requests"] - before["requests"])
    parts = [f"{stage} {(after.get(stage, 0.0) - before.get(stage, 0.0)) / requests * 1e3:.3f}" for stage in STAGES]
    return "server ms per request (CPU; engine: wall): " + ", ".join(parts)


def engine_seconds(
    model: Path, sentences: list[list[str]], threads: int, repeats: int = 5, precision: str = "fp32"
) -> dict[int, float]:
    """Median engine time of each distinct sentence alone (batch 1), keyed by its index."""
    engine = Engine(model, provider="cpu", intra_op_threads=threads, precision=precision)
    engine.run([sentences[0]])
    out = {}
    for i, s in enumerate(sentences):
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            engine.run([s])
            times.append(time.perf_counter() - start)
        out[i] = float(np.median(times))
    return out


class Connection:
    """One keep-alive HTTP/1.1 connection that POSTs JSON and reads whole answers. The load generator shares the
    machine with the server, so it must take little of the CPU it measures: httpx took 3.2 ms of CPU per
    request here (7% of the 2 cores at 47 requests/s), this takes a small fraction of that."""

    def __init__(self, host: str, port: int):
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def post(self, path: str, body: bytes) -> tuple[int, bytes]:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        head = f"POST {path} HTTP/1.1\r\nhost: {self.host}\r\ncontent-type: application/json\r\n"
        self.writer.write(f"{head}content-length: {len(body)}\r\n\r\n".encode() + body)
        headers = await self.reader.readuntil(b"\r\n\r\n")
        length = int(re.search(rb"(?i)\r\ncontent-length: *(\d+)", headers).group(1))
        return int(headers[9:12]), await self.reader.readexactly(length)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


async def client_loop(url: str, sentences, start_index: int, stop_at: float, log, encoding: str, pooling: str):
    host, port, path = re.match(r"http://([^:/]+):(\d+)(/.*)", url).groups()
    connection = Connection(host, int(port))
    bodies = [orjson.dumps({"sentences": [s], "encoding": encoding, "pooling": pooling}) for s in sentences]
    i = start_index
    try:
        while time.perf_counter() < stop_at:
            k = i % len(sentences)
            start = time.perf_counter()
            status, answer = await asyncio.wait_for(connection.post(path, bodies[k]), 120)
            log.append((k, status, time.perf_counter() - start))
            if i == start_index and status == 200:  # parsing every answer would tax the server's CPU; check one
                assert len(orjson.loads(answer)["data"][0]["tokens"]) == len(sentences[k])
            i += 1
    finally:
        connection.close()


async def load(url: str, sentences, clients: int, seconds: float, encoding: str, pooling: str = "none") -> dict:
    log: list[tuple[int, int, float]] = []
    start = time.perf_counter()
    stop_at = start + seconds
    await asyncio.gather(*(client_loop(url, sentences, c * 7, stop_at, log, encoding, pooling) for c in range(clients)))
    wall = time.perf_counter() - start
    ok = [(k, t) for k, status, t in log if status == 200]
    errors = len(log) - len(ok)
    tokens = sum(len(sentences[k]) for k, _ in ok)
    return {
        "clients": clients,
        "requests": len(log),
        "errors": errors,
        "tokens_per_s": tokens / wall,
        "requests_per_s": len(ok) / wall,
        "latency": percentiles([t for _, t in ok]) if ok else {},
        "per_sentence": {k: t for k, t in ok},
        "samples": ok,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, help="exported model folder (default: full-size, random weights)")
    parser.add_argument("--clients", default="1,8,32,128")
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--encoding", default="float", choices=["float", "base64"])
    parser.add_argument("--pooling", default="none", choices=["none", "mean"], help="the requests' pooling")
    parser.add_argument("--precision", default="fp32", choices=["fp32", "int8"], help="the server's and bulk's")
    args = parser.parse_args()

    model = args.model or full_size_model() / "onnx"
    sentences = fixture_sentences()
    BUILD.mkdir(parents=True, exist_ok=True)
    opt = BiLMOptions.from_dict(orjson.loads((model / "manifest.json").read_bytes())["architecture"])
    yardstick = Yardstick(args.threads)
    print("\n".join(yardstick.lines(opt)), flush=True)
    served = {}

    # The best of two bulk runs: the bar is a ratio to it, and a run slowed by the VM would flatter the service.
    bulk = max(bulk_tokens_per_s(model, sentences * 20, args.threads, args.precision) for _ in range(2))
    print(f"model: {model}, precision {args.precision}")
    print(f"bulk elmo-embed: {bulk:.0f} tokens/s (embedding phase, without start-up; best of 2)")

    port = free_port()
    env = {**os.environ, "ELMO_INTRA_OP_THREADS": str(args.threads), "ELMO_LOG_LEVEL": "warning"}
    env["ELMO_PRECISION"] = args.precision
    server = subprocess.Popen(
        [sys.executable, "-c", "import sys; from service.cli import serve_main; sys.exit(serve_main())",
         "--model", str(model), "--port", str(port)],
        cwd=ROOT, env=env,
    )  # fmt: skip
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.time() + 120
        while True:
            try:
                if httpx.get(f"{base}/health/ready").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.time() > deadline or server.poll() is not None:
                raise SystemExit("server did not become ready")
            time.sleep(0.2)
        header = ["tokens/s", "% bulk", "req/s", "p50 ms", "p95 ms", "p99 ms", "errors"]
        print(f"{'clients':>8}" + "".join(f"{h:>10}" for h in header))
        for clients in map(int, args.clients.split(",")):
            before, stages_before = engine_metrics(base), stage_metrics(base)
            r = asyncio.run(load(f"{base}/embed", sentences, clients, args.seconds, args.encoding, args.pooling))
            after, stages_after = engine_metrics(base), stage_metrics(base)
            lat = {k: v * 1e3 for k, v in r["latency"].items()}
            served[clients] = r["tokens_per_s"]
            print(
                f"{clients:>8}{r['tokens_per_s']:>10.0f}{r['tokens_per_s'] / bulk:>10.0%}{r['requests_per_s']:>10.1f}"
                f"{lat.get('p50', 0):>10.0f}{lat.get('p95', 0):>10.0f}{lat.get('p99', 0):>10.0f}{r['errors']:>10}"
            )
            print(f"{'':>8}{stage_line(stages_before, stages_after)}")
            if clients == 1 and r["samples"]:
                # The engine's own batch-1 time per sentence, measured right after, while the server is idle
                # (batch-1 speed is bound by memory bandwidth and drifts on a shared VM: measure it close by).
                alone = engine_seconds(model, sentences, args.threads, precision=args.precision)
                ratios = [t / alone[k] for k, t in r["samples"]]
                in_server = (after[1] - before[1]) / max(1, len(r["samples"]))  # engine seconds per request
                mean_latency = float(np.mean([t for _, t in r["samples"]]))
                print(
                    f"{'':>8}lone request latency / engine time at batch 1: {mean_latency / in_server:.2f}x against"
                    f" the server's own engine (mean {mean_latency * 1e3:.0f} ms vs {in_server * 1e3:.0f} ms);"
                    f" p50 {np.median(ratios):.2f}x against an engine in this process"
                    f" ({np.median(list(alone.values())) * 1e3:.0f} ms median)"
                )
    finally:
        server.terminate()
        server.wait(timeout=30)
    yardstick.finish()
    print("\n".join(yardstick.lines(opt)))
    print(yardstick.result("bulk elmo-embed", args.precision, opt, bulk))
    for clients, tokens_per_s in served.items():
        print(yardstick.result(f"served, {clients} clients", args.precision, opt, tokens_per_s))


if __name__ == "__main__":
    main()
