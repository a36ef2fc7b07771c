"""The embedding pipeline below HTTP, in the order every request meets it: admission's counts (service/admission.py),
its texts tokenized in turns by address (service/tokenizing.py), admission's tokens, its answer's size held in the
answer budget, and its sentences awaited from the model's queue (service/models.py) while the client is there.
The routes (service/api/embed.py, openai.py) validate a request into a Job, hand it to `Embedder.embed` (/tokenize:
`Embedder.tokenized`) and encode what comes back; what the embedder needs of the request (whose it is, its hold on
the answer budget, how to wait while its client is there) comes as its Caller, so nothing here knows HTTP. Each
step's CPU time goes to the `elmo_stage_seconds` metric, and each is a span of the request's trace when traced."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import numpy as np
from opentelemetry import trace

from service import spans
from service.admission import Admission, Hold
from service.batching.batcher import Layers, Timings
from service.errors import NotReady
from service.metrics import Metrics
from service.mix import compose
from service.models import ServedModel
from service.settings import Settings
from service.text.moses import min_tokens, word_end
from service.tokenizing import TokenizeTurns

log = logging.getLogger("elmo.service")
Mix = tuple[list[float], float, str, bool]  # a mix's weights (one per layer), gamma, normalize and layer_norm


@dataclass(frozen=True)
class Ask:
    """What a request asks of each sentence's layers: `output` "mix" (its `mixes`; `single_mix`: one, given as the
    request's own fields, so unnested) or "layers" (`layer_ids`, each in 0..num_layers-1; None: all), mean-pooled
    or per token, scaled to unit length or not, as float32 or float16, with the boundaries' positions or not."""

    num_layers: int
    output: str = "mix"
    mixes: list[Mix] = field(default_factory=list)
    layer_ids: list[int] | None = None
    pooling: str = "none"
    single_mix: bool = True
    unit_length: bool = False
    dtype: str = "float32"
    boundaries: bool = False

    @property
    def count(self) -> int:
        """Vectors per token (or per sentence, pooled) in the answer."""
        return len(self.mixes) or (self.num_layers if self.layer_ids is None else len(self.layer_ids))

    @property
    def reads(self) -> int:
        """Layer vectors per token that composing reads: every layer per mix, or each layer asked for."""
        return self.num_layers * len(self.mixes) or self.count

    @property
    def pooled(self) -> bool:
        return self.pooling == "mean"

    def vectors(self, layers: Layers) -> np.ndarray:
        """One sentence's answer from its layers: mixed or picked, pooled, scaled (service/mix.py); float16 rounded
        once, after all that (half the bytes)."""
        out = compose(layers.result(boundaries=self.boundaries), self.output, self.layer_ids, self.mixes,
                      self.pooling, self.single_mix, self.unit_length)  # fmt: skip
        return out.astype(np.float16) if self.dtype == "float16" else out


@dataclass(frozen=True)
class Job:
    """One request's work for `model`: `items`, sentences (lists of tokens) or texts (tokenized by the model's
    language); `field`, what a refusal names; `truncate`, a sentence over the limit cut instead of refused; `ask`,
    what each sentence's answer is (None: its tokens alone, /tokenize's); `encoding` ("float", "base64" or "npz"),
    how the answer will be written, which its size depends on; `ways_out`, what a refusal for that size suggests."""

    model: ServedModel
    items: list
    field: str
    truncate: bool = False
    ask: Ask | None = None
    encoding: str = "float"
    ways_out: str = ""


def _unnoted(**known) -> None:
    pass


@dataclass(frozen=True)
class Caller:
    """What the embedder knows of who asked: `address`, whose turn its texts and sentences wait for and whose share
    of the answer budget it takes; `answers`, its hold on that budget (open until its answer is sent); `until_gone`,
    a step's work awaited while the client is there (cancelled, and ClientGone, once it has left); `note`, what the
    request's log lines say of it; `path`, what log_request_text names it by."""

    address: str
    answers: Hold
    until_gone: Callable[[Awaitable], Awaitable]
    note: Callable[..., None] = _unnoted
    path: str = ""


@dataclass(frozen=True)
class Embedded:
    """A job's results: its sentences as queued (tokens), what each item reports of its cut, each sentence's
    layers, and the answer's estimated size, held in the answer budget."""

    job: Job
    sentences: list[list[str]]
    cuts: list[dict]
    layers: list[Layers]
    size: int

    @property
    def numbers(self) -> int:
        """The layer numbers composing the answer reads (positions x dim x layer vectors read per position)."""
        ask, sentences = self.job.ask, self.sentences
        positions = sum(map(len, sentences)) + 2 * ask.boundaries * len(sentences)
        return positions * self.job.model.dim * ask.reads


class Embedder:
    """Jobs through the pipeline, its steps in their order, for the app's `settings` (`ready`: every model loaded and
    warm; while draining too, since a request that got in is still served)."""

    def __init__(
        self,
        settings: Settings,
        metrics: Metrics,
        tokenizer: TokenizeTurns,
        tracer: trace.Tracer,
        ready: Callable[[], bool],
    ):
        self.settings, self.metrics, self.tokenizer, self.tracer = settings, metrics, tokenizer, tracer
        self.ready, self.admission = ready, Admission(settings)

    async def embed(self, job: Job, caller: Caller) -> Embedded:
        """The job's layers, within every limit: tokenized, its answer's size held, awaited from the queue."""
        sentences, cuts = await self._tokenized(job, caller)
        size = self.admission.answer_size(job.model.dim, sentences, job.ask.count, job.ask.pooled, job.encoding,
                                          job.field, job.ways_out, job.ask.boundaries)  # fmt: skip
        caller.answers.take(size)  # 503 if the budget cannot hold it; held until the answer is sent
        layers = await self._queued(job, sentences, caller)
        return Embedded(job, sentences, cuts, layers, size)

    async def tokenized(self, job: Job, caller: Caller) -> tuple[list[list[str]], list[dict]]:
        """The job's sentences as tokens, within the limits, and what each item reports of its cut."""
        caller.note(model=job.model.name)
        return await self._tokenized(job, caller)

    async def _tokenized(self, job: Job, caller: Caller) -> tuple[list[list[str]], list[dict]]:
        """The job's sentences as tokens (texts by the Moses rules of the model's language) within the limits (an
        empty sentence only where its boundaries are asked for), and what each item reports of its cut. Refused on
        cheap counts first, so an oversized request costs no tokenization; texts are tokenized off the event loop
        (Moses takes seconds on a long text, and the loop must keep answering everyone else)."""
        items, field, truncate, language = job.items, job.field, job.truncate, job.model.language
        self.admission.before_tokenizing(items, field, truncate)
        sentences, at_least = items, {}
        if texts := sum(isinstance(x, str) for x in items):
            if truncate:  # only what can be kept is tokenized: a text's first words, and a margin for Moses' splits
                items, at_least = _kept_parts(items, self.settings.max_tokens_per_sentence)
            stop = threading.Event()
            future = self.tokenizer.submit(caller.address, items, language, stop)
            with spans.span(self.tracer, "elmo.tokenize", texts=texts, language=language) as span:
                try:
                    sentences = await caller.until_gone(asyncio.wrap_future(future))
                finally:
                    stop.set()  # done already, or its texts leave the line
                if span is not None:
                    span.set_attribute("elmo.tokens", sum(map(len, sentences)))
        empty = job.ask is not None and job.ask.boundaries
        tokens, cuts = self.admission.tokens(sentences, field, truncate, empty)
        for i, words in at_least.items():  # cut before Moses: its tokens were not all counted
            cuts[i] = {"truncated": True, "original_tokens": words, "original_tokens_at_least": True}
        caller.note(sentences=len(tokens), tokens=sum(map(len, tokens)))
        return tokens, cuts

    async def _queued(self, job: Job, sentences: list[list[str]], caller: Caller) -> list[Layers]:
        """Each sentence's layers from the model's queue, in the turn of the caller's address; dropped from the queue
        and from flight if the client goes away first."""
        if not self.ready():
            raise NotReady("not ready (starting or stopped)")
        model = job.model
        if self.settings.log_request_text:  # off by default: request text never reaches the logs
            log.info("%s %s %s", caller.path, model.name, sentences)
        caller.note(model=model.name)
        started = time.perf_counter()
        timings = Timings() if spans.tracing() else None
        layers = await caller.until_gone(model.embed(sentences, caller.address, job.field, timings))
        self.metrics.observe_stage("engine", time.perf_counter() - started)
        if timings is not None and timings.started is not None and timings.answered is not None:
            counts = {"model": model.name, "sentences": len(sentences), "tokens": sum(map(len, sentences))}
            spans.record(self.tracer, "elmo.queue", timings.queued, timings.started, **counts)
            spans.record(self.tracer, "elmo.inference", timings.started, timings.answered, **counts)
        return layers


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
