"""An embedding request's own steps as child spans of its server span (service/api/tracing.py configures the
export): `elmo.tokenize` (texts through Moses), `elmo.queue` (waiting in the model's queue), `elmo.inference` (from
joining those in flight to the last sentence answered) and `elmo.encode` (the answer composed and encoded), with the
model and the counts as attributes, never the text. Below HTTP, so that the embedder (service/embedder.py) records
its steps without knowing the app; a request that is not traced costs each step one look at the current span."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

from opentelemetry import trace

from service import __version__


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
