"""Tracing, off by default: FastAPI's own OpenTelemetry support (`FastAPI(telemetry=...)`, fastapi 0.143 and later)
makes a server span for each request and, with the standard variables (OTEL_EXPORTER_OTLP_ENDPOINT or
OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, OTEL_SERVICE_NAME, OTEL_TRACES_SAMPLER...), exports them over OTLP/HTTP; this
module adds the embedding request's own steps as its children: `elmo.tokenize` (texts through Moses),
`elmo.queue` (waiting in the model's queue), `elmo.inference` (from joining those in flight to the last sentence
answered) and `elmo.encode` (the answer composed and encoded), with the model and the counts as attributes, never
the text. The SDK and the exporter are the `otel` extra: without them, or without an endpoint, FastAPI makes no
span and each step here costs one look at the current span.

The health probes and /metrics make no spans (PROBES): a probe every few seconds per pod would drown the traces."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from importlib.util import find_spec

from opentelemetry import trace

from service import __version__

log = logging.getLogger("elmo.service")
# The probes and the scrapes: no spans, and no access lines (a probe every few seconds per pod would drown both)
PROBES = frozenset({"/health/live", "/health/ready", "/metrics"})
ENDPOINTS = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")


def _untraced(scope) -> bool:
    return scope.get("path") in PROBES


def telemetry(tracer_provider: trace.TracerProvider | None = None) -> dict:
    """What create_app gives FastAPI(telemetry=...): export configured from the OTEL_* variables at start-up (where
    an endpoint is set and the SDK is installed), or into `tracer_provider` (the tests' in-memory exporter); no
    OpenTelemetry logs (the service's own lines go to stderr, and an exception's message could carry request
    text); no spans for the probes and /metrics."""
    config = {"logs": False, "exclude": _untraced, "auto_configure": _exporting()}
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
    return True


def _installed(module: str) -> bool:
    try:
        return find_spec(module) is not None
    except ImportError:  # a parent package missing
        return False


def tracer(provider: trace.TracerProvider | None = None) -> trace.Tracer:
    """The service's tracer: on `provider`, or on the global one (a proxy until FastAPI sets it at start-up)."""
    return trace.get_tracer("elmo.service", __version__, tracer_provider=provider)


def tracing() -> bool:
    """Whether this request is traced (its server span records): the steps below do nothing otherwise."""
    return trace.get_current_span().is_recording()


@contextmanager
def span(tracer: trace.Tracer, name: str, **attributes) -> Iterator[trace.Span | None]:
    """A child span of the request's around the block, if the request is traced."""
    if not tracing():
        yield None
        return
    with tracer.start_as_current_span(name, attributes=_named(attributes)) as child:
        yield child


def record(tracer: trace.Tracer, name: str, start: float, end: float, **attributes) -> None:
    """A child span of the request's that began and ended at `start` and `end` (time.perf_counter() seconds, as the
    batcher measures them), if the request is traced."""
    if not tracing() or end < start:
        return
    offset = time.time_ns() - time.perf_counter_ns()
    child = tracer.start_span(name, start_time=offset + int(start * 1e9), attributes=_named(attributes))
    child.end(end_time=offset + int(end * 1e9))


def _named(attributes: dict) -> dict:
    return {f"elmo.{k}": v for k, v in attributes.items() if v is not None}
