"""The app: its parts made once (create_app), its middleware in order, its routers, and its lifespan (the models
loaded and warmed before readiness, drained and stopped after the last request)."""

from __future__ import annotations

import asyncio
import logging
import sys
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from fastapi_offline import FastAPIOffline

from service import __version__, spans
from service.admission import answer_budget, body_budget
from service.api import embed, errors, health, openai, tracing
from service.api.dependencies import Runtime
from service.api.explore import ExplorePage
from service.api.middleware import (
    AnswerRelease,
    ApiKeys,
    BodyLimit,
    ContentEncodingRefused,
    DrainCutoff,
    HeadAsGet,
    RequestMetrics,
)
from service.api.request_id import RequestId
from service.api.static import StaticAnswers
from service.embedder import Embedder
from service.metrics import Metrics
from service.models import StartupFailed, load_models
from service.settings import Settings
from service.text.moses import tokenize
from service.tokenizing import TokenizeTurns

log = logging.getLogger("elmo.service")


def create_app(settings: Settings | None = None, tracer_provider=None) -> FastAPI:
    """The app for `settings`; its spans go to `tracer_provider` if given (the tests'), else where the OTEL_*
    variables say (service/api/tracing.py: nowhere by default)."""
    settings = settings or Settings()
    metrics = Metrics()
    keys = ApiKeys(None, keys=[key.get_secret_value() for key in settings.api_keys])  # its check, for tracing
    # FastAPIOffline: a FastAPI app whose /docs and /redoc load Swagger UI and ReDoc from the package's own files
    # (under /static-offline-docs), so they work where no CDN can be reached; no validator badge (it calls out).
    app = FastAPIOffline(
        title="ELMo embeddings",
        version=__version__,
        description="Deep contextualized word vectors (Peters et al., 2018) from an exported biLM.",
        lifespan=lifespan,
        swagger_ui_parameters={"validatorUrl": None},
        # FastAPI's own OpenTelemetry support: off until configured; no span for a request the keys refuse
        telemetry=tracing.telemetry(tracer_provider, refused=keys.refuses),
    )
    app.state.tracer_provider = tracer_provider
    app.state.tracer = spans.tracer(tracer_provider)  # the request's own steps, as its server span's children
    # Tokenizing and large answers each on threads of their own: neither waits behind the other, nor behind
    # anything else using asyncio's default pool (six abandoned texts once held every worker for 80 s).
    tokenizer = TokenizeTurns(
        settings.tokenize_threads,
        settings.max_tokenize_chars_per_client or settings.max_body_bytes,
        tokenize,
        metrics.observe_stage,
        processes=True,  # Moses off the interpreter lock the event loop needs (service/tokenizing.py)
    )
    app.state.runtime = Runtime(
        settings,
        metrics,
        Embedder(settings, metrics, tokenizer, app.state.tracer, ready=lambda: app.state.ready),
        answer_budget(settings, metrics),
        ThreadPoolExecutor(settings.encode_threads, thread_name_prefix="encode"),
        # Large bodies parsed off the loop: one at a time, so that what they build at once stays one body's worth.
        ThreadPoolExecutor(1, thread_name_prefix="parse"),
    )
    app.state.models = None  # the ModelRegistry, once the lifespan has loaded it
    app.state.ready = False  # every model's engine is loaded and warm, and its batcher runs
    app.state.draining = False  # a stop signal came: not ready for more, but finishing what is in flight
    add_middleware(app, app.state.runtime)
    errors.install(app, settings.retry_after_s)
    for router in (embed.router, openai.router, health.router):
        app.include_router(router)
    return app


def add_middleware(app: FastAPI, parts: Runtime) -> None:
    """Outermost last: HEAD is GET to every part; the request id on every answer and log line; metrics see every
    answer; CORS answers preflights (which carry no key) and puts its headers on a 401 too; keys are checked before
    a body is read, and before the answers that never change are sent from memory; a body in a content coding is
    refused, and a body is bounded, before anything parses it. Each error answer is written in its shape (OpenAI's
    under /v1/) where it is made (service/api/errors.py)."""
    settings = parts.settings
    app.add_middleware(
        BodyLimit,
        limit=settings.max_body_bytes,
        budget=body_budget(settings, parts.metrics),
        retry_after_s=settings.retry_after_s,
        timeout_s=settings.body_timeout_s,
        min_rate=settings.body_min_rate,
    )
    app.add_middleware(ContentEncodingRefused)  # before the body is read
    app.add_middleware(AnswerRelease, budget=parts.answers)  # what a request took of the answer budget, given back
    app.add_middleware(StaticAnswers, fastapi=app)  # the OpenAPI document and the docs' files, from memory
    app.add_middleware(ApiKeys, keys=[key.get_secret_value() for key in settings.api_keys])
    if settings.explore:  # outside the keys: the page asks for one itself and sends it with its API calls
        app.add_middleware(ExplorePage)
    app.add_middleware(DrainCutoff, draining=lambda: app.state.draining, retry_after_s=settings.retry_after_s)
    if settings.cors_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=settings.cors_origins,
            allow_methods=["GET", "POST"],
            allow_headers=["authorization", "content-type"],
        )
    app.add_middleware(RequestMetrics, metrics=parts.metrics)
    app.add_middleware(RequestId, access_log=settings.access_log)  # every answer, errors too, carries the id
    app.add_middleware(HeadAsGet)  # every part sees GET: the same keys, routes and answers
    app.add_middleware(StartupReport)  # the lifespan's scope only


@asynccontextmanager
async def lifespan(app: FastAPI):
    parts: Runtime = app.state.runtime
    tracing.redact_spans(app.state.tracer_provider)  # FastAPI has configured its provider from OTEL_* by now
    # every model, or StartupFailed naming the one that failed; on a thread, so that the event loop serves the
    # metrics port (ELMO_METRICS_PORT) while the models load, as it did when that port had a thread of its own
    parts.embedder.tokenizer.warm()  # its processes start while the models load
    models = await asyncio.to_thread(load_models, parts.settings, parts.metrics)
    app.state.models = models
    await models.start()  # each warmed: readiness covers them all
    app.state.ready = True
    for model in models:
        log.info("serving %s from %s (%s)", model.name, model.folder, model.engine.provider)
    log.info("listening on %s", f"{parts.settings.host}:{parts.settings.port}")
    yield
    app.state.ready = False
    await models.stop()  # after every request in flight was answered: nothing is queued any more
    parts.embedder.tokenizer.shutdown()
    parts.encode_pool.shutdown(wait=False, cancel_futures=True)
    parts.parse_pool.shutdown(wait=False, cancel_futures=True)
    log.info("stopped")


class StartupReport:
    """A start-up that fails with StartupFailed, reported in its one line: Starlette sends the server the
    lifespan's exception with its traceback, which uvicorn logs (30 lines for one broken graph among the models);
    a StartupFailed was logged, one line naming the model and what is wrong, where it was raised."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "lifespan":
            return await self.app(scope, receive, send)

        async def reporting(message):
            # Starlette sends this inside its `except` around the lifespan: the exception is the one in hand
            if message["type"] == "lifespan.startup.failed" and isinstance(sys.exc_info()[1], StartupFailed):
                message = {**message, "message": ""}  # uvicorn logs none, then "Application startup failed"
            await send(message)

        await self.app(scope, receive, reporting)


def start_draining(app: FastAPI) -> None:
    """A stop signal came: /health/ready answers 503 from now on (balancers stop sending); requests in
    flight are still answered. Safe to call from a signal handler: it only sets a flag."""
    app.state.draining = True
