"""The HTTP API: thin routes that validate, enqueue, await and encode. Batching lives in batcher.py,
ONNX Runtime in engine.py, the arithmetic of mixes in mix.py."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import TypeVar

import numpy as np
from fastapi import FastAPI, Request
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import PlainTextResponse, Response
from fastapi_offline import FastAPIOffline
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from service.batcher import QueueFull, TooLarge
from service.encode import (
    BYTES_PER_NUMBER,
    JSON,
    NPZ,
    Abandoned,
    Base64,
    answer_bytes,
    json_response,
    respond,
    wants_npz,
)
from service.metrics import Metrics
from service.middleware import AnswerBudget, ApiKeys, BodyLimit, DrainCutoff, RequestMetrics
from service.mix import compose
from service.openai_errors import OpenAIErrors
from service.schemas import (
    MAX_OUTPUTS,
    EmbedRequest,
    EmbedResponse,
    ErrorResponse,
    ModelList,
    ModelObject,
    OpenAIEmbeddingRequest,
    OpenAIEmbeddingResponse,
    OpenAIErrorResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from service.served import ServedModel, ServedModels, UnknownModel, load_models, shown
from service.settings import Settings
from service.tokenize import max_tokens, min_tokens, tokenize

log = logging.getLogger("elmo.service")
DISCONNECT_POLL_S = 0.05
ERRORS = {code: {"model": ErrorResponse} for code in (401, 404, 413, 422, 503)}  # 404: an unknown `model`
OPENAI_ERRORS = {code: {"model": OpenAIErrorResponse} for code in (400, 401, 404, 503)}  # /v1/*: openai_errors.py
MAX_ERRORS = 10  # a body with 100 000 wrong tokens is told about the first few, not in a 10 MB answer
T = TypeVar("T")


class ApiError(Exception):
    """A client error with its status and the field it concerns."""

    def __init__(self, status: int, message: str, field: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.field, self.headers = status, field, headers


def _json(payload, status: int = 200, headers: dict | None = None) -> Response:
    return json_response(payload, status, headers)


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings()
    metrics = Metrics()
    # Tokenizing and large answers each on threads of their own: neither waits behind the other, nor behind
    # anything else using asyncio's default pool; work for a client that has gone stops (see `off_loop`).
    tokenize_pool = ThreadPoolExecutor(settings.tokenize_threads, thread_name_prefix="tokenize")
    encode_pool = ThreadPoolExecutor(settings.encode_threads, thread_name_prefix="encode")
    answers = AnswerBudget(settings.max_answers_inflight_bytes, metrics)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        models = load_models(settings, metrics)  # every model, or a RuntimeError naming the one that failed
        app.state.models = models
        await models.start()  # each warmed: readiness covers them all
        app.state.ready = True
        for model in models:
            log.info("serving %s from %s (%s)", model.name, model.folder, model.engine.provider)
        log.info("listening on %s", f"{settings.host}:{settings.port}")
        yield
        app.state.ready = False
        await models.stop()  # after every request in flight was answered: nothing is queued any more
        tokenize_pool.shutdown(wait=False, cancel_futures=True)
        encode_pool.shutdown(wait=False, cancel_futures=True)
        log.info("stopped")

    # FastAPIOffline: a FastAPI app whose /docs and /redoc load Swagger UI and ReDoc from the package's own files
    # (under /static-offline-docs), so they work where no CDN can be reached; no validator badge (it calls out).
    app = FastAPIOffline(
        title="ELMo embeddings",
        version="0.1.0",
        description="Deep contextualized word vectors (Peters et al., 2018) from an exported biLM.",
        lifespan=lifespan,
        swagger_ui_parameters={"validatorUrl": None},
    )
    app.state.settings, app.state.metrics = settings, metrics
    app.state.ready = False  # every model's engine is loaded and warm, and its batcher runs
    app.state.draining = False  # a stop signal came: not ready for more, but finishing what is in flight
    # Outermost last: metrics see every answer; CORS answers preflights (which carry no key) and puts its
    # headers on a 401 too; keys are checked before a body is read.
    app.add_middleware(
        BodyLimit,
        limit=settings.max_body_bytes,
        inflight=settings.max_inflight_bytes,
        per_client=settings.max_inflight_bytes_per_client,
        retry_after_s=settings.retry_after_s,
        timeout_s=settings.body_timeout_s,
        min_rate=settings.body_min_rate,
        metrics=metrics,
    )
    app.add_middleware(answers.releasing)  # what a request took of the answer budget is given back after it
    app.add_middleware(ApiKeys, keys=[key.get_secret_value() for key in settings.api_keys])
    app.add_middleware(DrainCutoff, draining=lambda: app.state.draining, retry_after_s=settings.retry_after_s)
    if settings.cors_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=settings.cors_origins,
            allow_methods=["GET", "POST"],
            allow_headers=["authorization", "content-type"],
        )
    app.add_middleware(OpenAIErrors)  # under /v1/, every error above in OpenAI's shape
    app.add_middleware(RequestMetrics, metrics=metrics)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, exc: RequestValidationError):
        every = exc.errors()
        errors = [
            {"loc": [_cut(p) for p in e.get("loc", ())], "msg": e.get("msg", ""), "type": e.get("type", "")}
            for e in every[:MAX_ERRORS]
        ]
        more = {"more_errors": len(every) - MAX_ERRORS} if len(every) > MAX_ERRORS else {}
        first = errors[0] if errors else {"loc": [], "msg": "invalid body"}
        if first.get("type") == "json_invalid":  # its loc is ("body", character offset): the field is the body
            reason = (every[0].get("ctx") or {}).get("error", "")
            detail = f"body: invalid JSON at character {first['loc'][-1]}: {reason}"
            return _json({"detail": detail, "errors": errors, **more}, status=422)
        field = ".".join(str(p) for p in first["loc"] if p != "body") or "body"
        reason = _not_json(request) if field == "body" else None
        return _json({"detail": f"{field}: {reason or first['msg']}", "errors": errors, **more}, status=422)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        # FastAPI answers 400 to a body that json.loads fails on other than with JSONDecodeError (bytes that are
        # not UTF-8, nesting deeper than the recursion limit): that too is an invalid body, so 422 like the rest.
        if exc.status_code == 400 and isinstance(exc.__cause__, (ValueError, RecursionError)):
            return _json({"detail": f"body: not valid JSON ({type(exc.__cause__).__name__})"}, status=422)
        return await http_exception_handler(request, exc)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError):
        detail = f"{exc.field}: {exc}" if exc.field else str(exc)
        return _json({"detail": detail}, status=exc.status, headers=exc.headers)

    def served_models() -> ServedModels:
        models = getattr(app.state, "models", None)
        if models is None:  # not loaded yet (uvicorn serves nothing before the lifespan has started)
            raise ApiError(503, "not ready (starting or stopped)", headers=_retry(settings))
        return models

    def model_named(name: str | None) -> ServedModel:
        """The model a request names (None: the default), or 404 naming those served."""
        try:
            return served_models().get(name)
        except UnknownModel as err:
            raise ApiError(404, str(err), "model") from None

    async def embed_tokens(
        request: Request, model: ServedModel, sentences: list[list[str]], field: str
    ) -> list[np.ndarray]:
        """Queue the sentences on the model's queue, and drop them if the client goes away before they ran. While
        draining, a request that got in is still served: the server stopped accepting connections already."""
        if not app.state.ready:
            raise ApiError(503, "not ready (starting or stopped)", headers=_retry(settings))
        if settings.log_request_text:  # off by default: request text never reaches the logs
            log.info("%s %s %s", request.url.path, model.name, sentences)
        started = time.perf_counter()
        client = request.client.host if request.client else ""  # whose turn its sentences wait for
        task = asyncio.ensure_future(model.batcher.embed(sentences, client))
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                break
            if await request.is_disconnected():
                task.cancel()
                raise ApiError(499, "client closed the request")
        try:
            results = task.result()
            observe("engine", time.perf_counter() - started)
            return results
        except TooLarge as err:
            raise ApiError(413, str(err), field) from None
        except QueueFull as err:  # this model's queue: the other models' are their own
            metrics.rejected.labels(model.name).inc()
            raise ApiError(
                503, f"overloaded: model {model.name}'s {err}; retry later", headers=_retry(settings)
            ) from None
        except Exception as err:
            log.exception("engine batch failed")
            raise ApiError(503, f"inference failed ({type(err).__name__}); retry", headers=_retry(settings)) from None

    observe = metrics.observe_stage

    def _tokenize_timed(items: list, language: str, stop: threading.Event) -> list[list[str]]:
        start = time.thread_time()
        sentences = []
        for x in items:
            if stop.is_set():
                raise Abandoned
            sentences.append(tokenize(x, language) if isinstance(x, str) else x)
        observe("tokenize", time.thread_time() - start)
        return sentences

    async def off_loop(request: Request, pool: ThreadPoolExecutor, work: Callable[[threading.Event], T]) -> T:
        """`work(stop)` on a thread of `pool`, while the event loop serves others. If the client goes away
        meanwhile (checked every DISCONNECT_POLL_S), or the request is cancelled, `stop` is set, so that the work
        ends at its next check (Abandoned), and the request ends 499; work still waiting for a thread never
        starts."""
        stop = threading.Event()
        future = asyncio.get_running_loop().run_in_executor(pool, work, stop)
        try:
            while True:
                done, _ = await asyncio.wait({future}, timeout=DISCONNECT_POLL_S)
                if done:
                    return future.result()
                if await request.is_disconnected():
                    raise ApiError(499, "client closed the request")
        finally:
            if not future.done():
                stop.set()
                future.cancel()

    def offload(request: Request):
        return lambda work: off_loop(request, encode_pool, work)

    def observe_parse(request: Request) -> None:
        read = request.scope.get("state", {}).get("body_read_cpu")
        if read is not None:
            observe("parse", time.thread_time() - read)

    async def tokenized(
        request: Request, items: list, field: str, truncate: bool, language: str
    ) -> tuple[list[list[str]], list[dict]]:
        """The request's sentences as tokens (texts by the Moses rules of `language`, the model's), within the
        limits, and what each item reports of its cut (`_truncate`). Refused (413) on cheap counts first, so an
        oversized request costs no tokenization; strings are tokenized off the event loop (Moses takes seconds on a
        long text, and the loop must keep answering everyone else). With `truncate`, a sentence over the
        tokens-per-sentence limit is not refused but cut to it."""
        if len(items) > settings.max_sentences:
            raise ApiError(413, f"{len(items)} sentences; the limit is {settings.max_sentences} per request", field)
        for i, x in enumerate(items):
            if isinstance(x, str) and len(x) > settings.max_text_chars:
                limit = settings.max_text_chars
                raise ApiError(413, f"{len(x)} characters; the limit is {limit} per text", f"{field}[{i}]")
        at_least = [min_tokens(x) if isinstance(x, str) else len(x) for x in items]
        for i, n in enumerate(at_least):
            if n > settings.max_tokens_per_sentence and not truncate:
                counted = f"at least {n}" if isinstance(items[i], str) else str(n)
                limit = settings.max_tokens_per_sentence
                raise ApiError(413, f"{counted} tokens; the limit is {limit}", f"{field}[{i}]")
        at_most = _at_most(items, settings.max_tokens_per_sentence, field, truncate)  # before Moses reads a text
        if (total := sum(at_most) + 2 * len(items)) > settings.queue_tokens:  # every model's queue holds as many
            raise ApiError(413, str(TooLarge(total, settings.queue_tokens)), field)
        sentences = items
        if any(isinstance(x, str) for x in items):
            sentences = await off_loop(request, tokenize_pool, lambda stop: _tokenize_timed(items, language, stop))
        for i, tokens in enumerate(sentences):
            if not tokens:
                raise ApiError(422, "empty sentence", f"{field}[{i}]")
            if _has_surrogate(tokens):
                raise ApiError(422, "not valid Unicode (a lone surrogate such as \\ud800)", f"{field}[{i}]")
            if len(tokens) > settings.max_tokens_per_sentence and not truncate:
                raise ApiError(
                    413, f"{len(tokens)} tokens; the limit is {settings.max_tokens_per_sentence}", f"{field}[{i}]"
                )
        return _truncate(sentences, settings.max_tokens_per_sentence, truncate)

    def answer_size(
        request: Request,
        dim: int,
        sentences: list[list[str]],
        outputs: int,
        pooled: bool,
        encoding: str,
        field: str,
        ways_out: str,
    ) -> int:
        """The answer's size for vectors of `dim`, estimated before the engine runs: 413 over the limit, naming the
        ways out; 503 while the answers being made or sent hold too much of the answer budget to take it (it is
        held from now until the answer is sent)."""
        size = answer_bytes([len(s) for s in sentences], dim, outputs, pooled, encoding)
        if size > settings.max_answer_bytes:
            vectors = len(sentences) if pooled else sum(map(len, sentences))
            shape = f"{outputs} x {vectors} vectors of {dim}" if outputs > 1 else f"{vectors} vectors of {dim}"
            raise ApiError(
                413,
                f"an answer of up to {size} bytes ({shape} numbers as {encoding}); the limit is "
                f"{settings.max_answer_bytes} bytes per answer: ask for {ways_out}",
                field,
            )
        if refused := answers.take(request.scope, size):
            raise ApiError(503, refused, headers=_retry(settings))
        return size

    npz_answer = {
        200: {
            "content": {NPZ: {}},
            "description": "with `Accept: application/x-npz`: the answer as an .npz (README, POST /embed)",
        }
    }

    @app.post(
        "/embed",
        response_model=EmbedResponse,
        responses={**ERRORS, **npz_answer},
        summary="ELMo vectors of sentences",
    )
    async def embed(body: EmbedRequest, request: Request):
        observe_parse(request)
        model = model_named(body.model)
        npz = wants_npz(request.headers.get("accept", ""))
        encoding = "npz" if npz else body.encoding
        num_layers = model.num_layers
        mixes, layer_ids = _resolve_output(body, num_layers)
        language = model.engine.info.language
        sentences, cuts = await tokenized(request, body.sentences, "sentences", body.truncate, language)
        outputs = len(mixes) or (num_layers if layer_ids is None else len(layer_ids))
        smaller = "" if npz else '"encoding": "base64", '  # the .npz is already the smallest encoding
        ways_out = f'"pooling": "mean", {smaller}fewer layers or mixes, or fewer sentences per request'
        pooled = body.pooling == "mean"
        size = answer_size(request, model.dim, sentences, outputs, pooled, encoding, "sentences", ways_out)
        results = await embed_tokens(request, model, sentences, "sentences")
        # numbers composing reads: every layer per mix, or each layer asked for
        numbers = sum(map(len, sentences)) * model.dim * (num_layers * len(mixes) or outputs)

        def answer(stop: threading.Event | None = None) -> dict:
            data = []
            for i, (tokens, layers, cut) in enumerate(zip(sentences, results, cuts, strict=True)):
                if stop is not None and stop.is_set():
                    raise Abandoned
                single_mix = body.mixes is None
                out = compose(layers, body.output, layer_ids, mixes, body.pooling, single_mix, body.unit_length)
                embedding = Base64(out) if encoding == "base64" else out
                data.append({"index": i, "tokens": tokens, "embedding": embedding, "shape": list(out.shape), **cut})
            return {
                "model": model.name,
                "dim": model.dim,
                "num_layers": num_layers,
                "data": data,
                "usage": {"sentences": len(sentences), "tokens": sum(map(len, sentences))},
            }

        # The same request answers JSON or .npz by its Accept header: caches must tell them apart.
        return await respond(
            answer, size, npz, observe, headers={"vary": "accept"}, numbers=numbers, offload=offload(request)
        )

    @app.post(
        "/v1/embeddings",
        response_model=OpenAIEmbeddingResponse,
        responses=OPENAI_ERRORS,
        summary="OpenAI-style: one vector per input (mean-pooled average of the layers)",
    )
    async def openai_embeddings(body: OpenAIEmbeddingRequest, request: Request):
        observe_parse(request)
        model = model_named(body.model)
        texts = [body.input] if isinstance(body.input, str) else body.input
        if not texts:
            raise ApiError(422, "empty list", "input")
        dim = model.dim
        if body.dimensions is not None and body.dimensions != dim:  # ignoring it would hand back the wrong size
            raise ApiError(422, f"{body.dimensions} asked for; this model's vectors have {dim}", "dimensions")
        sentences, cuts = await tokenized(request, texts, "input", body.truncate, model.engine.info.language)
        ways_out = '"encoding_format": "base64", or fewer inputs per request'
        size = answer_size(request, dim, sentences, 1, True, body.encoding_format, "input", ways_out)
        results = await embed_tokens(request, model, sentences, "input")
        default_mix = [([0.0] * model.num_layers, 1.0, "softmax", False)]
        numbers = sum(map(len, sentences)) * dim * model.num_layers

        def answer(stop: threading.Event | None = None) -> dict:
            data = []
            for i, (layers, cut) in enumerate(zip(results, cuts, strict=True)):
                if stop is not None and stop.is_set():
                    raise Abandoned
                vector = compose(layers, "mix", None, default_mix, "mean", single_mix=True, unit=body.unit_length)
                embedding = Base64(vector) if body.encoding_format == "base64" else vector
                data.append({"object": "embedding", "index": i, "embedding": embedding, **cut})
            tokens = sum(map(len, sentences))
            return {
                "object": "list",
                "data": data,
                "model": model.name,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            }

        return await respond(answer, size, observe=observe, numbers=numbers, offload=offload(request))

    @app.post(
        "/tokenize",
        response_model=TokenizeResponse,
        responses=ERRORS,
        summary="the tokens /embed reads from the same sentences, and the bytes of each that the model reads",
    )
    async def tokenize_sentences(body: TokenizeRequest, request: Request):
        model = model_named(body.model)
        language = model.engine.info.language
        sentences, cuts = await tokenized(request, body.sentences, "sentences", body.truncate, language)
        mapping = model.engine.mapping
        data = []
        for i, (tokens, cut) in enumerate(zip(sentences, cuts, strict=True)):
            utf8, kept = zip(*(mapping.kept(t) for t in tokens), strict=True)
            uncut = {"truncated": False, "original_tokens": len(tokens)}  # reported with or without truncate
            data.append({"index": i, "tokens": tokens, "utf8_bytes": utf8, "kept_bytes": kept, **uncut, **cut})
        return _json(
            {
                "model": model.name,
                "max_tokens_per_sentence": settings.max_tokens_per_sentence,
                "max_bytes_per_token": mapping.max_bytes,
                "token_cut": mapping.cut,
                "data": data,
                "usage": {"sentences": len(sentences), "tokens": sum(map(len, sentences))},
            }
        )

    @app.get("/health/live", summary="the process is up")
    async def live():
        return {"status": "live"}

    @app.get(
        "/health/ready",
        summary="200 once every model is loaded and warm; 503 while starting or draining",
        responses={
            503: {"description": "not ready", "content": {"application/json": {"example": {"status": "draining"}}}}
        },
    )
    async def ready():
        if app.state.ready and not app.state.draining:
            return {"status": "ready"}
        status = "draining" if app.state.draining else "not ready"
        return _json({"status": status}, status=503, headers=_retry(settings))

    @app.get(
        "/info",
        summary="the model (the default, or ?model=name), its shape, the provider, the settings in force, and every "
        "model served",
        responses={401: {"model": ErrorResponse}, 404: {"model": ErrorResponse}},
    )
    async def info(model: str | None = None):
        chosen = model_named(model)
        return _json(
            {
                "model": chosen.name,
                **_described(chosen),
                "settings": settings.public(batch_tokens=chosen.batch_tokens),
                "answer_media_types": {"/embed": [JSON, NPZ]},  # by Accept; the other routes answer JSON
                # process-wide, but for queue_tokens (each model's queue holds as many) and batch_tokens (the model's)
                "limits": {
                    "max_sentences": settings.max_sentences,
                    "max_tokens_per_sentence": settings.max_tokens_per_sentence,
                    "max_body_bytes": settings.max_body_bytes,
                    "max_inflight_bytes": settings.max_inflight_bytes,
                    "max_inflight_bytes_per_client": settings.max_inflight_bytes_per_client,
                    "max_answers_inflight_bytes": settings.max_answers_inflight_bytes,
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
                    "queue_tokens": settings.queue_tokens,
                    "batch_tokens": chosen.batch_tokens,
                },
                # every model served, in order (the first is the default), with its own queue and batch budget
                "models": {
                    m.name: {
                        **_described(m),
                        "model_dir": m.folder.name,  # its name: the server's paths are not shown
                        "created": m.created,
                        "queue_tokens": settings.queue_tokens,
                        "batch_tokens": m.batch_tokens,
                    }
                    for m in app.state.models
                },
            }
        )

    @app.get(
        "/v1/models",
        response_model=ModelList,
        responses={code: OPENAI_ERRORS[code] for code in (401, 503)},
        summary="OpenAI-style: the models served, the default first",
    )
    async def list_models():
        return _json({"object": "list", "data": [_model_object(m) for m in served_models()]})

    @app.get(
        "/v1/models/{model_id}",
        response_model=ModelObject,
        responses={code: OPENAI_ERRORS[code] for code in (401, 404, 503)},
        summary="OpenAI-style: one model served",
    )
    async def retrieve_model(model_id: str):
        return _json(_model_object(model_named(model_id)))

    @app.get("/metrics", summary="Prometheus metrics", response_class=PlainTextResponse)
    async def prometheus():
        for model in getattr(app.state, "models", ()):
            metrics.queue_tokens.labels(model.name).set(model.batcher.queued_tokens)
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


def start_draining(app: FastAPI) -> None:
    """A stop signal came: /health/ready answers 503 from now on (balancers stop sending); requests in
    flight are still answered. Safe to call from a signal handler: it only sets a flag."""
    app.state.draining = True


def _described(model: ServedModel) -> dict:
    """What /info says of a model: its shape, provider, the graph served and the export's manifest."""
    engine = model.engine
    return {
        "dim": engine.dim,
        "num_layers": engine.num_layers,
        "provider": engine.provider,
        # the graph served, and what its precision costs (measured at export; bench/gpu.py on a GPU)
        "precision": engine.graph.precision,
        "graph": engine.graph.entry,
        "canary": model.canary.to_dict(),  # the start-up check against the reference (service/canary.py)
        "manifest": engine.info.manifest,
    }


def _model_object(model: ServedModel) -> dict:
    """A model as OpenAI's /v1/models lists one, with its shape."""
    return {
        "id": model.name,
        "object": "model",
        "created": model.created,
        "owned_by": "elmo-service",
        "dim": model.dim,
        "num_layers": model.num_layers,
    }


def _has_surrogate(tokens: list[str]) -> bool:
    # JSON may escape one (\ud800); it cannot be written back as UTF-8, so the response could not echo it.
    try:
        "".join(tokens).encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _truncate(sentences: list[list[str]], limit: int, truncate: bool) -> tuple[list[list[str]], list[dict]]:
    """With `truncate`, each sentence cut to its first `limit` tokens (TEI's auto-truncate), and what its item
    reports of the cut; without, the sentences as they are (`tokenized` refused any over the limit)."""
    if not truncate:
        return sentences, [{}] * len(sentences)
    cuts = [{"truncated": len(s) > limit, "original_tokens": len(s)} for s in sentences]
    return [s[:limit] for s in sentences], cuts


# With truncate, a text is not refused for its tokens but cut after Moses has read it: up to this many times the
# limit (by the upper bound that counts punctuation), so that Moses's work stays bounded.
TRUNCATE_READS = 16


def _at_most(items: list, limit: int, field: str, truncate: bool = False) -> list[int]:
    """Each sentence's tokens, or for a text an upper bound on what Moses will make of it, as queued (with
    `truncate`, at most `limit`): over the limit (with `truncate`, over TRUNCATE_READS times it), 413 before Moses
    reads it (`"a," * 4_000_000` is one word by whitespace and 8 million tokens)."""
    readable = limit * TRUNCATE_READS if truncate else limit
    counts = [max_tokens(x, stop=readable + 1) if isinstance(x, str) else len(x) for x in items]
    for i, n in enumerate(counts):
        if (isinstance(items[i], str) and n > readable) if truncate else n > limit:  # a list is cut, not read
            cut = f" to truncate (at most {readable})" if truncate else ""
            raise ApiError(
                413,
                f"over {readable} words and punctuation marks (each may be a token){cut}; the limit is {limit} "
                "tokens: send it shorter, or as a list of tokens",
                f"{field}[{i}]",
            )
    return [min(n, limit) for n in counts]


def _not_json(request: Request) -> str | None:
    """Why a body is not read as JSON, if its Content-Type says another type (curl -d sends a form's type): FastAPI
    then validates its bytes, and its message ("Input should be a valid dictionary") would not say why."""
    declared = request.headers.get("content-type")
    kind = (declared or "").split(";")[0].strip().lower()
    if declared is None or kind == "application/json" or kind.endswith("+json"):
        return None
    return (
        f"sent as {kind or 'an empty Content-Type'}, not JSON: send the header Content-Type: application/json "
        "(curl: -H 'content-type: application/json')"
    )


def _cut(part: str | int) -> str | int:
    return shown(part) if isinstance(part, str) else part  # an unknown field's name may be a megabyte long


def _retry(settings: Settings) -> dict:
    return {"Retry-After": str(settings.retry_after_s)}


def _resolve_output(body: EmbedRequest, num_layers: int):
    """The mixes (weights, gamma, normalize, layer_norm) and layer ids a request asks for, checked."""
    mix_fields = {"weights", "gamma", "normalize", "layer_norm"} & body.model_fields_set
    if body.output == "layers":
        for name in sorted(mix_fields | ({"mixes"} & body.model_fields_set)):
            raise ApiError(422, 'only with output "mix"', name)
        ids = body.layers
        for k, layer in enumerate(ids or []):
            if not -num_layers <= layer < num_layers:
                raise ApiError(422, f"layer {layer} out of range: the model has {num_layers} layers", f"layers[{k}]")
        return [], None if ids is None else [layer % num_layers for layer in ids]
    if body.layers is not None:
        raise ApiError(422, 'only with output "layers"', "layers")
    if body.mixes is not None:
        if mix_fields:
            raise ApiError(422, f"give either mixes or {', '.join(sorted(mix_fields))}", "mixes")
        specs = [(m, f"mixes[{k}].weights") for k, m in enumerate(body.mixes)]
    else:
        specs = [(body, "weights")]
    mixes = []
    for spec, field in specs:
        weights = [0.0] * num_layers if spec.weights is None else spec.weights
        if len(weights) != num_layers:
            raise ApiError(422, f"{len(weights)} weights; the model has {num_layers} layers", field)
        mixes.append((weights, spec.gamma, spec.normalize, spec.layer_norm))
    return mixes, None
