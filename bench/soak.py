"""Soak: many mixed requests against one elmo-serve, watching throughput, answers by status and the server's
resident memory (not part of the tests: it takes minutes).

    .venv/bin/python -m bench.soak [--requests 20000] [--concurrency 2] [--model DIR | --url URL [--pid PID]]

By default it exports the tiny fixture biLM once (build/bench/elmo-tiny) and starts its own elmo-serve on
127.0.0.1. The mix is seeded, so every run sends the same requests: /embed with the default mix, per-layer
vectors as base64, several mixes mean-pooled, texts for the server to tokenize, tokens of 1000 characters;
/v1/embeddings (one text or several, float or base64); invalid bodies (422) and over-limit ones (413); and
clients that leave before their answer (the server looks every 50 ms, so on the tiny model most of those are
computed before it notices; on a real one they are dropped, 499). Half the sentences carry a new word, so the
token cache keeps turning over. Every answer is checked where that is cheap: the status its kind calls for
(or 503 with Retry-After), and the tokens sent coming back in their order.

A warm-up first (--warmup requests of the same mix, a tenth as many of its largest requests, and enough new
words to fill the token cache) brings the process to its steady size; RSS is read then (start), after every
tenth of the requests, and at the end. The bar: growth from start to end under 10%. Exits 1 when an answer
was unexpected or the bar is missed.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import httpx
import orjson
from prometheus_client.parser import text_string_to_metric_families

from bench.common import fixture_sentences, start_server, tiny_model

GROWTH_BAR = 0.10
LEAVE_AFTER_S = 0.01  # a leaving client gives up this soon after sending (its request takes longer)


@dataclass(frozen=True)
class Request:
    kind: str
    path: str
    body: bytes
    expect: int  # the status its kind calls for (503 with Retry-After is always allowed: overload)
    tokens: list | None = None  # /embed with token lists: what must come back, in order


def make_request(i: int, seed: int, words: list[str], sentences: list[list[str]]) -> Request:
    rng = random.Random(seed * 1_000_003 + i)

    def sentence() -> list[str]:
        s = list(rng.choice(sentences)[: rng.randint(1, 40)])
        if rng.random() < 0.5:  # a new word: the token cache keeps turning over
            s.insert(rng.randrange(len(s) + 1), f"w{rng.randrange(10**9)}")
        return s

    def embed(kind: str, payload: dict, expect: int = 200, tokens: list | None = None) -> Request:
        return Request(kind, "/embed", orjson.dumps(payload), expect, tokens)

    roll = rng.random()
    if roll < 0.25:
        s = [sentence() for _ in range(rng.randint(1, 4))]
        return embed("embed-mix", {"sentences": s}, tokens=s)
    if roll < 0.40:
        s = [sentence() for _ in range(rng.randint(1, 4))]
        return embed("embed-layers-base64", {"sentences": s, "output": "layers", "encoding": "base64"}, tokens=s)
    if roll < 0.52:
        s = [sentence() for _ in range(rng.randint(1, 8))]
        mixes = [{"weights": [rng.uniform(-1, 1) for _ in range(3)], "gamma": 0.5}, {"layer_norm": True}]
        return embed("embed-pooled-mixes", {"sentences": s, "mixes": mixes, "pooling": "mean"}, tokens=s)
    if roll < 0.60:
        texts = [" ".join(sentence()) for _ in range(rng.randint(1, 3))]
        return embed("embed-texts", {"sentences": texts})
    if roll < 0.63:
        s = [[*sentence(), "".join(rng.choice(words) for _ in range(200))[:1000]]]
        return embed("embed-long-token", {"sentences": s, "pooling": "mean"}, tokens=s)
    if roll < 0.78:
        texts = [" ".join(sentence()) for _ in range(rng.randint(1, 4))]
        payload = {"input": texts[0] if len(texts) == 1 else texts, "encoding_format": rng.choice(["float", "base64"])}
        return Request("openai", "/v1/embeddings", orjson.dumps(payload), 200)
    if roll < 0.88:
        bad = rng.choice(
            [
                b'{"sentences": [["a"]], "weights": [1.0]}',
                b'{"sentences": [["a", 1]]}',
                b'{"sentences": [["a"]], "gamma": NaN}',
                b'{"sentences": [["a"]',
                b'{"sentences": [["\\ud800"]]}',
                b'{"sentences": [["a"]], "output": "layers", "layers": [7]}',
                b"",
            ]
        )
        return Request("invalid", "/embed", bad, 422)
    if roll < 0.90:
        return embed("over-limit", {"sentences": [["a"]] * 600}, expect=413)
    if roll < 0.905:
        s = [sentence() for _ in range(256)]  # about 4000 tokens: still running when its client leaves
        return embed("client-leaves", {"sentences": s, "pooling": "mean"}, expect=0)
    s = [sentence()]
    return embed("embed-one", {"sentences": s, "encoding": "base64"}, tokens=s)


def rss_mib(pid: int | None) -> float | None:
    if pid is None:
        return None
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return None


class Soak:
    def __init__(self, url: str, pid: int | None, concurrency: int):
        self.url, self.pid, self.concurrency = url, pid, concurrency
        self.statuses: Counter[str] = Counter()
        self.unexpected: list[str] = []
        self.tokens = 0

    async def send(self, http: httpx.AsyncClient, request: Request) -> None:
        headers = {"content-type": "application/json"}
        if request.expect == 0:  # the client leaves before its answer
            try:
                await asyncio.wait_for(http.post(request.path, content=request.body, headers=headers), LEAVE_AFTER_S)
            except (asyncio.TimeoutError, httpx.TransportError):
                self.statuses["left"] += 1
                return
            self.statuses["left too late"] += 1
            return
        response = await http.post(request.path, content=request.body, headers=headers)
        self.statuses[str(response.status_code)] += 1
        if response.status_code == 503 and response.headers.get("retry-after"):
            return
        if response.status_code != request.expect:
            self.unexpected.append(f"{request.kind}: {response.status_code} {response.text[:200]}")
            return
        if request.tokens is not None:
            got = [item["tokens"] for item in orjson.loads(response.content)["data"]]
            if got != request.tokens:
                self.unexpected.append(f"{request.kind}: tokens of another request came back")
        if response.status_code == 200 and request.path == "/embed" and request.tokens is not None:
            self.tokens += sum(map(len, request.tokens))

    async def run(self, requests: list[Request], every=None) -> float:
        """Send them all, `concurrency` at a time; `every(done)` after each tenth of them."""
        queue = iter(range(len(requests)))
        done = 0
        limits = httpx.Limits(max_connections=self.concurrency, max_keepalive_connections=self.concurrency)
        async with httpx.AsyncClient(base_url=self.url, timeout=120, limits=limits) as http:

            async def worker():
                nonlocal done
                for i in queue:
                    await self.send(http, requests[i])
                    done += 1
                    if every is not None and done % max(1, len(requests) // 10) == 0:
                        every(done)

            start = time.perf_counter()
            await asyncio.gather(*(worker() for _ in range(self.concurrency)))
            return time.perf_counter() - start


def server_counts(url: str) -> Counter[str]:
    """Requests by status, as the server's /metrics counts them (all routes but /metrics itself)."""
    counts: Counter[str] = Counter()
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        for sample in family.samples:
            if sample.name == "elmo_requests_total" and sample.labels["route"] != "/metrics":
                counts[sample.labels["status"]] += sample.value
    return counts


def fill_token_cache(url: str) -> None:
    """New words until the server's token cache is full: its bounded size is part of the steady state."""
    size = httpx.get(f"{url}/info").json()["settings"]["token_cache"]
    with httpx.Client(base_url=url, timeout=120) as http:
        for k in range(0, size, 500):
            words = [f"fill{k + j}" for j in range(500)]
            http.post("/embed", json={"sentences": [words[:250], words[250:]], "pooling": "mean"}).raise_for_status()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--warmup", type=int, default=2_000, help="requests before RSS is first read")
    parser.add_argument("--concurrency", type=int, default=2, help="clients at once (default 2: a shared machine)")
    parser.add_argument("--threads", type=int, default=1, help="ONNX Runtime threads of the server it starts")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", type=Path, help="exported model folder (default: the tiny fixture biLM)")
    parser.add_argument("--url", help="soak a running server instead of starting one")
    parser.add_argument("--pid", type=int, help="with --url: the server's process id, for its RSS")
    args = parser.parse_args()

    words = [w for s in fixture_sentences() for w in s]
    sentences = fixture_sentences()
    server = None
    if args.url:
        url, pid, model = args.url.rstrip("/"), args.pid, "(running server)"
    else:
        model = args.model or tiny_model()
        server, url, _ = start_server(model, args.threads)
        pid = server.pid
    try:
        warmup = [make_request(i, args.seed + 1, words, sentences) for i in range(args.warmup)]
        # The largest requests, more often than in the mix: ONNX Runtime's arena grows to its working size on
        # the largest batches (measured: in steps over the first ~200 of them, then flat).
        largest = [r for r in (make_request(i, args.seed + 2, words, sentences) for i in range(60_000))
                   if r.kind == "client-leaves"][: args.warmup // 10]  # fmt: skip
        warmup += [Request("largest", r.path, r.body, 200) for r in largest]
        requests = [make_request(i, args.seed, words, sentences) for i in range(args.requests)]
        kinds = Counter(r.kind for r in requests)
        fill_token_cache(url)
        asyncio.run(Soak(url, pid, args.concurrency).run(warmup))

        counted_before = server_counts(url)
        rss = {0: rss_mib(pid)}
        soak = Soak(url, pid, args.concurrency)
        seconds = asyncio.run(soak.run(requests, every=lambda done: rss.__setitem__(done, rss_mib(pid))))
        start, middle, end = rss[0], rss[min(rss, key=lambda k: abs(k - len(requests) / 2))], rss[max(rss)]
        counted = server_counts(url) - counted_before

        print(f"model: {model}; {args.requests} requests, concurrency {args.concurrency}, after {args.warmup} warm-up")
        print("mix: " + ", ".join(f"{k} {n}" for k, n in sorted(kinds.items(), key=lambda kv: -kv[1])))
        ok = soak.statuses["200"]
        print(
            f"throughput: {args.requests / seconds:.0f} requests/s ({ok / seconds:.0f} answered 200/s, "
            f"{soak.tokens / seconds:.0f} /embed tokens/s) over {seconds:.1f} s"
        )
        print("answers by status: " + ", ".join(f"{k}: {n}" for k, n in sorted(soak.statuses.items())))
        print("the server counted: " + ", ".join(f"{k}: {n:.0f}" for k, n in sorted(counted.items())))
        print(f"unexpected answers: {len(soak.unexpected)}")
        for line in soak.unexpected[:10]:
            print(f"  {line}")
        failed = bool(soak.unexpected)
        if start is not None:
            growth = end / start - 1
            print(
                f"server RSS: start {start:.1f} MiB, middle {middle:.1f} MiB, end {end:.1f} MiB;"
                f" growth {growth:+.1%} (bar: under {GROWTH_BAR:.0%})"
            )
            print("RSS every tenth, MiB: " + " ".join(f"{rss[k]:.1f}" for k in sorted(rss)))
            failed |= growth >= GROWTH_BAR
        return 1 if failed else 0
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=60)


if __name__ == "__main__":
    sys.exit(main())
