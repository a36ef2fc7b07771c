"""What every embedding route does at the HTTP edge around the embedder (service/embedder.py, which runs the
pipeline): the request as the embedder's Caller, the parse's CPU time, and the answer composed and encoded
(service/api/answers.py) in the `elmo.encode` span. Each step's CPU time goes to the `elmo_stage_seconds` metric."""

from __future__ import annotations

import time
from functools import partial

from fastapi import Request
from fastapi.responses import Response

from service import spans
from service.api.answers import Build, Offload, respond
from service.api.cancellation import off_loop, until_disconnected
from service.api.dependencies import runtime
from service.api.middleware import answer_hold, client_address
from service.api.request_id import note
from service.embedder import Caller, Embedded, Embedder


def embedder(request: Request) -> Embedder:
    return runtime(request).embedder


def caller(request: Request) -> Caller:
    """The request as the embedder knows it: its address, its hold on the answer budget, its client's leaving
    (service/api/cancellation.py), its log line's fields, its path."""
    scope = request.scope
    return Caller(client_address(scope), answer_hold(scope), partial(until_disconnected, request), note,
                  request.url.path)  # fmt: skip


async def encoded(
    request: Request, build: Build, embedded: Embedded, npz: bool = False, headers: dict | None = None
) -> Response:
    """The answer `build` composes from `embedded`, encoded as its job asked (service/api/answers.py's respond)."""
    job, observe = embedded.job, runtime(request).metrics.observe_stage
    attributes = {"model": job.model.name, "encoding": job.encoding, "bytes": embedded.size}
    with spans.span(request.app.state.tracer, "elmo.encode", **attributes):
        return await respond(build, embedded.size, npz, observe, headers, embedded.numbers, offload(request))


def observe_parse(request: Request) -> None:
    """The CPU time from the body's last byte to the route: its JSON parsing and validation."""
    read = request.scope.get("state", {}).get("body_read_cpu")
    if read is not None:
        runtime(request).metrics.observe_stage("parse", time.thread_time() - read)


def offload(request: Request) -> Offload:
    """Where a large answer is composed and encoded: the encode pool, stopped if the client goes."""
    return lambda work: off_loop(request, runtime(request).encode_pool, work)
