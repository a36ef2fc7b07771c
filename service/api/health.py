"""What operators and orchestrators read: the health probes (/health/live, /health/ready), /info (the models, the
settings and limits in force) and /metrics (Prometheus)."""

from __future__ import annotations

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from service import __version__
from service.admission import BYTES_PER_NUMBER
from service.api.answers import JSON, NPZ, json_response
from service.api.dependencies import model_named, runtime
from service.api.request_id import HEADER, request_id
from service.api.schemas import MAX_OUTPUTS, ErrorResponse
from service.models import ServedModel

router = APIRouter()
LIVE_PATH = "/health/live"
LIVE = orjson.dumps({"status": "live"})


@router.get(LIVE_PATH, summary="the process is up")
async def live():
    return Response(LIVE, media_type="application/json")


async def live_answer(scope, receive, send) -> None:
    """/health/live's answer as an ASGI app of its own, the same as the route's, which the HTTP server gives
    without the app's middleware or turns (service/server/protocol.py): the process is up; with its X-Request-Id,
    as every answer the app gives (service/api/request_id.py)."""
    rid = request_id([value for name, value in scope["headers"] if name == HEADER]).encode("ascii")
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(LIVE)), (HEADER, rid)]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": b"" if scope["method"] == "HEAD" else LIVE})


@router.get(
    "/health/ready",
    summary="200 once every model is loaded and warm; 503 while starting or draining",
    responses={503: {"description": "not ready", "content": {"application/json": {"example": {"status": "draining"}}}}},
)
async def ready(request: Request):
    state = request.app.state
    if state.ready and not state.draining:
        return {"status": "ready"}
    status = "draining" if state.draining else "not ready"
    return json_response(
        {"status": status}, status=503, headers={"Retry-After": str(runtime(request).settings.retry_after_s)}
    )


@router.get(
    "/info",
    summary="the model (the default, or ?model=name), its shape, the provider, the settings in force, and every "
    "model served",
    responses={401: {"model": ErrorResponse}, 404: {"model": ErrorResponse}},
)
async def info(request: Request, model: str | None = None):
    chosen = model_named(request, model)
    settings = runtime(request).settings
    caps = getattr(request.app.state, "connections", None)  # service/server/serve.py: the connections' caps in force
    return json_response(
        {
            "model": chosen.name,
            "version": __version__,  # the service's (elmo-serve --version)
            **described(chosen),
            "settings": settings.public(batch_tokens=chosen.batch_tokens, window=chosen.window),
            "answer_media_types": {"/embed": [JSON, NPZ]},  # by Accept; the other routes answer JSON
            # process-wide, but for queue_tokens (each model's queue holds as many) and batch_tokens (the model's)
            "limits": {
                "max_sentences": settings.max_sentences,
                "max_tokens_per_sentence": settings.max_tokens_per_sentence,
                "max_body_bytes": settings.max_body_bytes,
                "max_inflight_bytes": settings.max_inflight_bytes,
                "max_inflight_bytes_per_client": settings.max_inflight_bytes_per_client,
                "max_answers_inflight_bytes": settings.max_answers_inflight_bytes,
                "max_answers_inflight_bytes_per_client": settings.max_answers_inflight_bytes_per_client,
                "max_layers_or_mixes": MAX_OUTPUTS,
                "max_text_chars": settings.max_text_chars,
                "max_answer_bytes": settings.max_answer_bytes,
                "answer_bytes_per_number": BYTES_PER_NUMBER,
                "max_header_bytes": settings.max_header_bytes,
                "max_headers": settings.max_headers,
                "head_timeout_s": settings.head_timeout_s,
                "body_timeout_s": settings.body_timeout_s,
                "body_min_rate": settings.body_min_rate,
                "write_timeout_s": settings.write_timeout_s,
                "max_pipelined": settings.max_pipelined,
                "max_connections": caps.limit if caps else None,
                "max_connections_per_client": caps.per_client if caps else None,
                "queue_tokens": settings.queue_tokens,
                "batch_tokens": chosen.batch_tokens,
            },
            # every model served, in order (the first is the default), with its own queue, batch budget and window
            "models": {
                m.name: {
                    **described(m),
                    "model_dir": m.folder.name,  # its name: the server's paths are not shown
                    "created": m.created,
                    "queue_tokens": settings.queue_tokens,
                    "batch_tokens": m.batch_tokens,
                    "window": m.window,
                }
                for m in request.app.state.models
            },
        }
    )


def described(model: ServedModel) -> dict:
    """What /info says of a model: its shape, provider, the graph served and the export's manifest."""
    engine = model.engine
    return {
        "dim": engine.dim,
        "num_layers": engine.num_layers,
        "provider": engine.provider,
        # the graph served, and what its precision costs (measured at export; bench/gpu.py on a GPU)
        "precision": engine.graph.precision,
        "graph": engine.graph.entry,
        "kernels": engine.kernels,  # the graphs' own ops by this project's compiled kernels (engine/native)
        "canary": model.canary.to_dict(),  # the start-up check against the reference (service/engine/canary.py)
        "manifest": engine.info.manifest,
    }


@router.get("/metrics", summary="Prometheus metrics", response_class=PlainTextResponse)
async def prometheus(request: Request):
    observe_queues(request.app)
    return Response(generate_latest(runtime(request).metrics.registry), media_type=CONTENT_TYPE_LATEST)


def observe_queues(app) -> None:
    """The gauges read at a scrape: each model's queue, now (here, and on ELMO_METRICS_PORT's)."""
    metrics = app.state.runtime.metrics
    for model in app.state.models or ():
        metrics.queue_tokens.labels(model.name).set(model.batcher.queued_tokens)
