"""The steps every embedding route takes, in order: its sentences tokenized within the limits, its answer's size
reserved, its layers awaited from the model's queue while the client is there, and the answer composed and
encoded (service/api/answers.py). Each step's CPU time goes to the `elmo_stage_seconds` metric."""

from __future__ import annotations

import asyncio
import logging
import threading
import time

from fastapi import Request

from service.api import tracing
from service.api.answers import Offload
from service.api.cancellation import off_loop, until_disconnected
from service.api.dependencies import ready, runtime
from service.api.middleware import client_address, hold_answer
from service.api.request_id import note
from service.batching.batcher import Layers, Timings
from service.models import ServedModel
from service.text.moses import min_tokens, word_end

log = logging.getLogger("elmo.service")


async def tokenized(
    request: Request, items: list, field: str, truncate: bool, language: str, empty: bool = False
) -> tuple[list[list[str]], list[dict]]:
    """The request's sentences as tokens (texts by the Moses rules of `language`, the model's) within the limits
    (an empty sentence only where `empty`), and what each item reports of its cut. Refused on cheap counts first,
    so an oversized request costs no tokenization; texts are tokenized off the event loop (Moses takes seconds on a
    long text, and the loop must keep answering everyone else)."""
    parts = runtime(request)
    parts.admission.before_tokenizing(items, field, truncate)
    sentences, at_least = items, {}
    if texts := sum(isinstance(x, str) for x in items):
        limit = parts.settings.max_tokens_per_sentence
        if truncate:  # only what can be kept is tokenized: a text's first words, and a margin for Moses' splits
            items, at_least = _kept_parts(items, limit)
        stop = threading.Event()
        future = parts.tokenizer.submit(client_address(request.scope), items, language, stop)
        with tracing.span(request.app.state.tracer, "elmo.tokenize", texts=texts, language=language) as span:
            try:
                sentences = await until_disconnected(request, asyncio.wrap_future(future))
            finally:
                stop.set()  # done already, or its texts leave the line
            if span is not None:
                span.set_attribute("elmo.tokens", sum(map(len, sentences)))
    tokens, cuts = parts.admission.tokens(sentences, field, truncate, empty)
    for i, words in at_least.items():  # cut before Moses: its tokens were not all counted
        cuts[i] = {"truncated": True, "original_tokens": words, "original_tokens_at_least": True}
    note(sentences=len(tokens), tokens=sum(map(len, tokens)))
    return tokens, cuts


# Words past the limit that a cut text keeps for Moses: its rules look at the next word (a non-breaking prefix such
# as "Dr." stays whole before a name) and at the text's end, so the tokens kept are those of the whole text.
CUT_MARGIN_WORDS = 16


def _kept_parts(items: list, limit: int) -> tuple[list, dict[int, int]]:
    """With truncate: each text of more than `limit` + CUT_MARGIN_WORDS words (by whitespace) cut after those,
    and for each cut text, its words: a lower bound on its tokens (Moses only splits words further)."""
    kept, at_least = list(items), {}
    for i, x in enumerate(items):
        if isinstance(x, str) and (end := word_end(x, limit + CUT_MARGIN_WORDS)) is not None:
            kept[i], at_least[i] = x[:end], min_tokens(x)
    return kept, at_least


def reserve_answer(
    request: Request,
    model: ServedModel,
    sentences: list[list[str]],
    outputs: int,
    pooled: bool,
    encoding: str,
    field: str,
    ways_out: str,
    boundaries: bool = False,
) -> int:
    """The answer's estimated size (`boundaries`: two more positions a sentence), within the per-answer limit (413,
    naming `ways_out`) and held from now until it is sent in the budget of the answers being made or sent (503 when
    that cannot hold it)."""
    parts = runtime(request)
    size = parts.admission.answer_size(model.dim, sentences, outputs, pooled, encoding, field, ways_out, boundaries)
    hold_answer(request.scope, parts.answers, size)
    return size


async def embedded(request: Request, model: ServedModel, sentences: list[list[str]], field: str) -> list[Layers]:
    """Each sentence's layers from `model`'s queue, in the turn of the client's address; dropped from the queue
    and from flight if the client goes away first. While draining, a request that got in is still served: the
    server stopped accepting connections already."""
    ready(request)
    parts = runtime(request)
    if parts.settings.log_request_text:  # off by default: request text never reaches the logs
        log.info("%s %s %s", request.url.path, model.name, sentences)
    note(model=model.name)
    started = time.perf_counter()
    client = request.client.host if request.client else ""  # whose turn its sentences wait for
    timings = Timings() if tracing.tracing() else None
    layers = await until_disconnected(request, model.embed(sentences, client, field, timings))
    parts.metrics.observe_stage("engine", time.perf_counter() - started)
    if timings is not None and timings.started is not None and timings.answered is not None:
        counts = {"model": model.name, "sentences": len(sentences), "tokens": sum(map(len, sentences))}
        tracer = request.app.state.tracer
        tracing.record(tracer, "elmo.queue", timings.queued, timings.started, **counts)
        tracing.record(tracer, "elmo.inference", timings.started, timings.answered, **counts)
    return layers


def observe_parse(request: Request) -> None:
    """The CPU time from the body's last byte to the route: its JSON parsing and validation."""
    read = request.scope.get("state", {}).get("body_read_cpu")
    if read is not None:
        runtime(request).metrics.observe_stage("parse", time.thread_time() - read)


def offload(request: Request) -> Offload:
    """Where a large answer is composed and encoded: the encode pool, stopped if the client goes."""
    return lambda work: off_loop(request, runtime(request).encode_pool, work)
