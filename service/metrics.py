"""Prometheus metrics: few, and named alike (elmo_*). One registry per app, so tests can run several."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from service.batching.batcher import BatchStats
from service.engine.canary import CanaryReport

# up to a GPU's windows: 1024 rows of 32 positions, and more
BATCH_TOKEN_BUCKETS = (16, 64, 256, 1024, 2048, 4096, 8192, 16384, 32768, 65536)
STAGE_BUCKETS = (0.0001, 0.0003, 0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1, 3, 10, 30)
# The stages of an embedding request the server's CPU does, in order (README, Other routes): `parse` the body's
# JSON and its validation, `tokenize` texts (Moses), `compose` the mixes and pooling, `encode` the answer; each the
# CPU time (time.thread_time) of the thread doing it. `engine` is the wall time the request awaited the engine.
STAGES = ("parse", "tokenize", "engine", "compose", "encode")
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("elmo_requests", "HTTP requests by route and status", ["route", "status"], registry=r)
        self.request_seconds = Histogram(
            "elmo_request_seconds", "HTTP request latency", ["route"], buckets=LATENCY_BUCKETS, registry=r
        )
        # Per model (its label): each has its own queue and engine.
        self.queue_tokens = Gauge("elmo_queue_tokens", "tokens waiting for the engine", ["model"], registry=r)
        self.queue_seconds = Histogram(
            "elmo_queue_seconds", "time from enqueue to joining those in flight", ["model"], buckets=LATENCY_BUCKETS,
            registry=r,
        )  # fmt: skip
        self.batch_sentences = Histogram(
            "elmo_batch_sentences", "sentences per engine call", ["model"],
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512), registry=r,
        )  # fmt: skip
        self.batch_tokens = Histogram(
            "elmo_batch_tokens", "padded positions per call", ["model"], buckets=BATCH_TOKEN_BUCKETS,
            registry=r,
        )  # fmt: skip
        self.inference_seconds = Histogram(
            "elmo_inference_seconds", "engine time per call", ["model"], buckets=LATENCY_BUCKETS, registry=r
        )
        self.stage_seconds = Histogram(
            "elmo_stage_seconds",
            "per embedding request: CPU time of each stage (parse, tokenize, compose, encode); wall time awaiting "
            "the engine, queued and computed (engine)",
            ["stage"],
            buckets=STAGE_BUCKETS,
            registry=r,
        )
        # What the in-flight budgets hold now (read at each scrape): request bodies read and not yet done with, and
        # the estimated sizes of the answers being made or sent.
        self.body_bytes = Gauge("elmo_body_bytes_held", "bytes of request bodies in flight", registry=r)
        self.answer_bytes = Gauge(
            "elmo_answer_bytes_held", "estimated bytes of the answers being made or sent", registry=r
        )
        self.rejected = Counter(
            "elmo_rejected", "requests refused with 503 because their model's queue was full", ["model"], registry=r
        )
        # The HTTP server's connections (service/server/connections.py): those held, and those refused by its caps.
        self.connections = Gauge("elmo_connections", "connections held by the HTTP server", registry=r)
        self.connections_refused = Counter(
            "elmo_connections_refused", "connections refused (503 and closed): over the cap per address (per_client) "
            "or in all (total)", ["reason"], registry=r,
        )  # fmt: skip
        # The start-up check of each model's engine (service/engine/canary.py); absent for an export without canaries.
        self.canary_error = Gauge(
            "elmo_canary_max_abs_error", "start-up canaries: max abs error against the reference", ["model"],
            registry=r,
        )  # fmt: skip
        self.canary_cosine = Gauge(
            "elmo_canary_min_cosine", "start-up canaries: min cosine per token vector against the reference",
            ["model"], registry=r,
        )  # fmt: skip
        self.canary_agree = Gauge(
            "elmo_canary_agree", "start-up canaries: 1 within the graph's allowance, 0 beyond it (ELMO_CANARY=warn)",
            ["model"], registry=r,
        )  # fmt: skip

    def batch_observer(self, model: str) -> Callable[[BatchStats], None]:
        """What a model's batcher calls after each engine call. Every per-model series of `model` exists from
        here on (at 0), so a scrape shows each model before its first request."""
        sentences, tokens = self.batch_sentences.labels(model), self.batch_tokens.labels(model)
        seconds, queued = self.inference_seconds.labels(model), self.queue_seconds.labels(model)
        self.queue_tokens.labels(model).set(0)
        self.rejected.labels(model)

        def observe(stats: BatchStats) -> None:
            sentences.observe(stats.sentences)
            tokens.observe(stats.padded_tokens)
            seconds.observe(stats.seconds)
            for waited in stats.queue_seconds:
                queued.observe(waited)

        return observe

    def observe_canary(self, model: str, report: CanaryReport) -> None:
        if report.checked:
            self.canary_error.labels(model).set(report.max_abs_error)
            self.canary_cosine.labels(model).set(report.min_cosine)
            self.canary_agree.labels(model).set(1 if report.passed else 0)

    def observe_stage(self, stage: str, seconds: float) -> None:
        self.stage_seconds.labels(stage).observe(seconds)
