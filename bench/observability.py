"""What following requests costs: the service's throughput, latency and CPU per request with JSON logs and an
access line per request, and with tracing exported over OTLP, each on and off.

    .venv/bin/python -m bench.observability [--model DIR] [--clients 8,32] [--seconds 20] [--threads 1] [--rounds 2]

For each configuration a real elmo-serve (the embedded default model unless --model), and for each concurrency N,
N closed-loop clients sending one-sentence POST /embed requests (bench/load.py's minimal client) for --seconds:
tokens/s, p50/p95 latency, and the server process's CPU ms per request (user + system, from /proc). Tracing
exports to a stand-in OTLP/HTTP collector on 127.0.0.1 that reads and drops what it is sent (the SDK's batch
processor serializes and posts every span, as it would to a real one). The configurations run in turns, --rounds
times, and each figure is the best of its rounds: the machine is shared, and a slow round says nothing of logging.
"""

from __future__ import annotations

import argparse
import asyncio
import http.server
import os
import threading
from pathlib import Path

from bench.common import BUILD, fixture_sentences, start_server
from bench.load import load
from service.settings import DEFAULT_MODEL_DIR

CONFIGURATIONS = {
    "off (text logs, no access lines, no tracing)": {},
    "JSON logs + access lines": {"ELMO_LOG_FORMAT": "json", "ELMO_ACCESS_LOG": "true", "ELMO_LOG_LEVEL": "info"},
    "tracing (OTLP/HTTP)": {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "{collector}/v1/traces"},
    "JSON logs + access lines + tracing": {
        "ELMO_LOG_FORMAT": "json",
        "ELMO_ACCESS_LOG": "true",
        "ELMO_LOG_LEVEL": "info",
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "{collector}/v1/traces",
    },
}


class Collector(http.server.BaseHTTPRequestHandler):
    """A stand-in OTLP/HTTP collector: reads each export and answers 200."""

    received = 0

    def do_POST(self):  # http.server's name
        self.rfile.read(int(self.headers.get("content-length", 0)))
        Collector.received += 1
        self.send_response(200)
        self.send_header("content-type", "application/x-protobuf")
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def cpu_flags() -> str:
    found = set()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            found |= {f for f in line.split() if f in ("avx2", "avx512_vnni")}
    return " ".join(sorted(found)) or "neither avx2 nor avx512_vnni"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL_DIR)
    parser.add_argument("--clients", default="8,32")
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()

    collector = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Collector)
    threading.Thread(target=collector.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{collector.server_address[1]}"
    sentences = fixture_sentences()
    BUILD.mkdir(parents=True, exist_ok=True)
    where = f"{args.threads} ONNX Runtime thread(s); CPU flags: {cpu_flags()}; {os.cpu_count()} cores"
    print(f"model: {args.model}; {where}", flush=True)
    best: dict[tuple[str, int], dict] = {}
    for _ in range(args.rounds):
        for name, settings in CONFIGURATIONS.items():
            settings = {k: v.format(collector=url) for k, v in settings.items()}
            log = BUILD / "observability-server.log"
            server, base, _ = start_server(args.model, args.threads, settings, log=log)
            try:
                for clients in map(int, args.clients.split(",")):
                    before = cpu_seconds(server.pid)
                    r = asyncio.run(load(f"{base}/embed", sentences, clients, args.seconds, "float"))
                    r["cpu_ms"] = (cpu_seconds(server.pid) - before) / max(1, r["requests"]) * 1e3
                    r["log_bytes"] = log.stat().st_size
                    key = (name, clients)
                    if key not in best or r["tokens_per_s"] > best[key]["tokens_per_s"]:
                        best[key] = r
            finally:
                server.terminate()
                server.wait(timeout=60)
    collector.shutdown()
    header = ["tokens/s", "req/s", "p50 ms", "p95 ms", "CPU ms/req", "errors"]
    print(f"{'configuration':<40}{'clients':>8}" + "".join(f"{h:>11}" for h in header))
    for (name, clients), r in best.items():
        lat = {k: v * 1e3 for k, v in r["latency"].items()}
        print(
            f"{name:<40}{clients:>8}{r['tokens_per_s']:>11.0f}{r['requests_per_s']:>11.1f}{lat.get('p50', 0):>11.1f}"
            f"{lat.get('p95', 0):>11.1f}{r['cpu_ms']:>11.2f}{r['errors']:>11}"
        )
    print(f"OTLP exports received by the stand-in collector: {Collector.received}")


if __name__ == "__main__":
    main()
