"""Tracing, off by default: FastAPI's own OpenTelemetry support (`FastAPI(telemetry=...)`, fastapi 0.143 and later)
makes a server span for each request and, with the standard variables (OTEL_EXPORTER_OTLP_ENDPOINT or
OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, OTEL_SERVICE_NAME, OTEL_TRACES_SAMPLER...), exports them over OTLP/HTTP; the
embedding request's own steps are their children (service/spans.py). The SDK and the exporter are the `otel`
extra: without them, or without an endpoint, FastAPI makes no span.

The health probes and /metrics make no spans (PROBES): a probe every few seconds per pod would drown the traces;
nor does a request the API keys refuse (a span per unauthenticated request would let anyone fill the traces). A
span carries the path cut to PATH_CHARS with its control characters escaped, and the query's names only, never
its values (`text=...&api_key=...` was exported whole); a caller's `traceparent` (and `tracestate`, `baggage`) is
honoured only from the trusted proxies (ELMO_FORWARDED_ALLOW_IPS): from anyone else it would force sampling and
join other traces. The exporter's calls are bounded (EXPORT_TIMEOUT_S each), so that a collector that never
answers cannot hold the exit past the grace period."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from importlib.util import find_spec

from opentelemetry import trace

from service.logs import escaped

log = logging.getLogger("elmo.service")
# The probes and the scrapes: no spans, and no access lines (a probe every few seconds per pod would drown both)
PROBES = frozenset({"/health/live", "/health/ready", "/metrics"})
ENDPOINTS = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
PATH_CHARS = 100  # of a span's url.path: enough to recognise it, not a place to carry text
QUERY_NAMES = 16  # of a span's url.query: the names of the first parameters, each cut to PATH_CHARS
# Each export's bound, and the export processor's: at exit the spans left are sent in a few calls, each given up
# after this (the default 10 s, four times over, held the exit 41.9 s with a collector that never answered).
EXPORT_TIMEOUT_S = 2
EXIT_EXPORT_S = 4 * EXPORT_TIMEOUT_S  # at most what the exit waits on the exporter: in the grace arithmetic
TRACE_HEADERS = frozenset({b"traceparent", b"tracestate", b"baggage"})


def telemetry(
    tracer_provider: trace.TracerProvider | None = None, refused: Callable[[dict], bool] | None = None
) -> dict:
    """What create_app gives FastAPI(telemetry=...): export configured from the OTEL_* variables at start-up (where
    an endpoint is set and the SDK is installed), or into `tracer_provider` (the tests' in-memory exporter); no
    OpenTelemetry logs (the service's own lines go to stderr, and an exception's message could carry request
    text); no spans for the probes and /metrics, nor for a request `refused` says the API keys refuse."""

    def untraced(scope) -> bool:
        return scope.get("path") in PROBES or (refused is not None and refused(scope))

    config = {"logs": False, "exclude": untraced, "auto_configure": _exporting()}
    if tracer_provider is not None:
        config["tracer_provider"] = tracer_provider
    return config


def _exporting() -> bool:
    """Whether the OTEL_* variables ask for export, and it can be done; a variable set without the SDK is said
    once, in the service's words, instead of FastAPI's."""
    if not any(os.environ.get(name) for name in ENDPOINTS) or os.environ.get("OTEL_SDK_DISABLED", "") == "true":
        return False
    if not (_installed("opentelemetry.sdk") and _installed("opentelemetry.exporter.otlp.proto.http")):
        log.warning(
            "an OTEL_EXPORTER_OTLP_*ENDPOINT is set, but the OpenTelemetry SDK is not installed: no traces "
            "(pip install 'elmo-service[otel]'; the images have it)"
        )
        return False
    os.environ.setdefault("OTEL_SERVICE_NAME", "elmo-service")  # read by the SDK's resource, when FastAPI makes it
    os.environ.setdefault("OTEL_EXPORTER_OTLP_TIMEOUT", str(EXPORT_TIMEOUT_S))  # seconds, each export call
    os.environ.setdefault("OTEL_BSP_EXPORT_TIMEOUT", str(EXPORT_TIMEOUT_S * 1000))  # milliseconds
    return True


try:  # the SDK is the `otel` extra: without it no provider takes processors, and none is made
    from opentelemetry.sdk.trace import SpanProcessor
except ImportError:  # pragma: no cover
    SpanProcessor = object


class Redacting(SpanProcessor):
    """A span processor that rewrites what FastAPI's server span says of the URL as it starts, before any
    exporter sees it: the path cut and escaped, the query reduced to its parameters' names."""

    def on_start(self, span, parent_context=None) -> None:
        attributes = getattr(span, "attributes", None) or {}
        if isinstance(path := attributes.get("url.path"), str):
            span.set_attribute("url.path", escaped(path[:PATH_CHARS]) + ("..." if len(path) > PATH_CHARS else ""))
        if isinstance(query := attributes.get("url.query"), str):
            names = [part.partition("=")[0][:PATH_CHARS] for part in query.split("&")[:QUERY_NAMES]]
            span.set_attribute("url.query", "&".join(escaped(f"{name}=REDACTED") for name in names))

    def _on_ending(self, span) -> None:  # the SDK calls it on its own processors' kind
        pass

    def on_end(self, span) -> None:
        pass

    def shutdown(self) -> None:
        pass

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


def redact_spans(provider=None) -> None:
    """Put Redacting on the tracer provider that FastAPI's spans go to (the tests', or the one it configured)."""
    provider = provider or trace.get_tracer_provider()
    if callable(add := getattr(provider, "add_span_processor", None)) and not getattr(provider, "_elmo_redacts", 0):
        add(Redacting())
        provider._elmo_redacts = True


class TraceContextGate:
    """Around the whole app, before uvicorn's proxy headers are read: a request's trace context headers are
    dropped unless its connection's peer is a trusted proxy (`trusted`: service/server/connections.py's Trusted)."""

    def __init__(self, app, trusted):
        self.app, self.trusted = app, trusted

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and any(name in TRACE_HEADERS for name, _ in scope.get("headers") or ()):
            peer = (scope.get("client") or ("",))[0]
            if peer not in self.trusted:
                scope = {**scope, "headers": [(n, v) for n, v in scope["headers"] if n not in TRACE_HEADERS]}
        return await self.app(scope, receive, send)


def _installed(module: str) -> bool:
    try:
        return find_spec(module) is not None
    except ImportError:  # a parent package missing
        return False
