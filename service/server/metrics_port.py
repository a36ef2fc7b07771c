"""/metrics on a port of its own (ELMO_METRICS_PORT, as text-embeddings-inference's --prometheus-port), without API
keys: Prometheus scrapes it as the Kubernetes annotations say, while every route of the main port stays behind
the keys.

It is served by the main port's bounded protocol (service/server/protocol.py: head timeout, header bytes and
count, pipelining and write bounds), in the main port's event loop, from before the models load until after the
drain (service/server/uvicorn_compat.SidePort), with connection caps of its own. It used to be prometheus_client's
thread-per-connection server: no timeouts, 100 header lines of 64 KB held per connection (150 connections: +926 MB
of RSS), a listen backlog of 5, and eight scrapers in a loop took a core and tripled the main port's p99.

What a scrape costs is bounded too: the registry is rendered at most once per CACHE_S however many scrape, and
at most RATE_PER_S scrapes a second are answered, the rest waiting their turn (MAX_WAIT_S at most, then 503 with
Retry-After), so that scrapers in a tight loop take a few answers a second of the event loop, not a core.
Only `GET /metrics` (and HEAD, wherever GET is answered: the same status and headers, no body) is served; any other
path is 404, any other method 405, a scrape over the pace 503: ServiceErrors, answered in the shape and with the
headers every error of the service has (service/errors.py)."""

from __future__ import annotations

import asyncio
import gzip
import time
from collections.abc import Callable

from prometheus_client.exposition import choose_encoder

from service.api.health import observe_queues
from service.errors import Overloaded, ServiceError, answer_headers, native_body

CACHE_S = 1.0  # a render serves every scrape for this long (Prometheus scrapes every 15 s or more)
RATE_PER_S = 10.0  # scrapes answered a second, over all connections (a few Prometheus replicas need < 1)
MAX_WAIT_S = 2.0  # a scrape waits this long at most for its turn; past it, 503
MAX_CONNECTIONS = 64  # connections held at once, over all addresses
MAX_PER_CLIENT = 8  # connections held at once from one address (a Prometheus keeps one per target)
PATH = "/metrics"


class _Frozen:
    """The registry's metric families as one render collected them: what prometheus_client's encoders read."""

    def __init__(self, families: list):
        self.families = families

    def collect(self):
        return iter(self.families)


class ScrapeCache:
    """The app's registry rendered at most once per `interval_s`, each format encoded (and gzipped) once per
    render: a scrape within the interval reads the bytes of the one before, and scrapes that come during a render
    wait for that one. Rendering and encoding run on a thread, not on the event loop that serves the main port
    (the whole registry takes milliseconds to collect and encode)."""

    def __init__(self, app, interval_s: float = CACHE_S, clock: Callable[[], float] = time.monotonic):
        self.app, self.interval_s, self.clock = app, interval_s, clock
        self.renders = 0  # registry renders so far
        self._at = float("-inf")
        self._frozen = _Frozen([])
        self._rendering: asyncio.Future | None = None
        self._encoded: dict[tuple[str, bool], asyncio.Future] = {}  # this render's, by (content type, gzipped)

    async def answer(self, accept: str, gzipped: bool) -> tuple[bytes, str]:
        """The body (gzipped if asked) and its content type, for a scraper that accepts `accept`."""
        loop = asyncio.get_running_loop()
        if self.clock() - self._at >= self.interval_s:
            if self._rendering is None:
                self._rendering = loop.run_in_executor(None, self._collect)
                self._rendering.add_done_callback(self._rendered)
            await asyncio.shield(self._rendering)  # a scrape that leaves does not cancel the others' render
        encoder, content_type = _encoder(accept)
        key = (content_type, gzipped)
        if key not in self._encoded:
            self._encoded[key] = loop.run_in_executor(None, _encode, encoder, self._frozen, gzipped)
        return await asyncio.shield(self._encoded[key]), content_type

    def _collect(self) -> list:
        observe_queues(self.app)  # the gauges read at a scrape
        return list(self.app.state.runtime.metrics.registry.collect())

    def _rendered(self, rendering: asyncio.Future) -> None:
        self._rendering = None
        if not rendering.cancelled() and rendering.exception() is None:
            self._frozen, self._encoded = _Frozen(rendering.result()), {}
            self._at = self.clock()
            self.renders += 1


def _encoder(accept: str):
    """prometheus_client's encoder for the Accept header; its text format where it cannot read the header (an
    OpenMetrics version that is not numbers raised TypeError: a 500 and a traceback a scrape, for anyone)."""
    try:
        return choose_encoder(accept)
    except Exception:
        return choose_encoder("")


def _encode(encoder, frozen: _Frozen, gzipped: bool) -> bytes:
    body = encoder(frozen)
    return gzip.compress(body, 6) if gzipped else body


class Pace:
    """At most `rate_per_s` answers a second: each scrape is given the next free slot, and waits for it; one whose
    slot is more than `max_wait_s` away is refused (None)."""

    def __init__(self, rate_per_s: float = RATE_PER_S, max_wait_s: float = MAX_WAIT_S, clock=time.monotonic):
        self.gap_s, self.max_wait_s, self.clock = 1.0 / rate_per_s, max_wait_s, clock
        self._next = float("-inf")

    def wait(self) -> float | None:
        """Seconds to wait for this scrape's slot (0: now), or None: refused."""
        now = self.clock()
        slot = max(now, self._next)
        if slot - now > self.max_wait_s:
            return None
        self._next = slot + self.gap_s
        return slot - now


class MetricsApp:
    """The ASGI app of the metrics port: `GET /metrics` from the cache, in the pace's slots; nothing else."""

    def __init__(self, app, cache: ScrapeCache | None = None, pace: Pace | None = None):
        self.cache = cache or ScrapeCache(app)
        self.pace = pace or Pace()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return  # no lifespan (the side port runs none) and no WebSocket (the protocol refuses upgrades)
        head = scope["method"] == "HEAD"  # answered wherever GET is, with GET's headers and no body
        try:
            wait = self._turn(scope)
        except ServiceError as err:
            body = native_body(err)
            await _send(send, err.status, answer_headers(err, len(body)), body, head)
            return
        if wait > 0:
            await asyncio.sleep(wait)
        headers = dict(scope["headers"])
        gzipped = b"gzip" in headers.get(b"accept-encoding", b"")
        body, content_type = await self.cache.answer(headers.get(b"accept", b"").decode("latin-1"), gzipped)
        extra = [(b"content-encoding", b"gzip")] if gzipped else []
        answer = [(b"content-type", content_type.encode()), (b"content-length", b"%d" % len(body)), *extra]
        await _send(send, 200, answer, body, head)

    def _turn(self, scope) -> float:
        """Seconds this scrape waits for its slot; a ServiceError where it is not served (answered as the main
        port answers its errors: service/errors.py's body and headers)."""
        if scope["path"] != PATH:
            raise ServiceError(f"not found: this port serves {PATH} alone", status=404)
        if scope["method"] not in ("GET", "HEAD"):
            raise ServiceError(f"{PATH} answers GET", status=405, headers=[(b"allow", b"GET, HEAD")])
        wait = self.pace.wait()
        if wait is None:
            raise Overloaded(f"over {RATE_PER_S:g} scrapes a second; retry later", retry_after=1)
        return wait


async def _send(send, status: int, headers: list, body: bytes, head: bool) -> None:
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": b"" if head else body})
