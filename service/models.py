"""The registry of the models one server serves (ELMO_MODELS, or ELMO_MODEL_DIR alone): each with its own engine,
rows in flight and batcher, so each has its own queue of `queue_tokens` (one model's overload never refuses
another's requests) and its own engine thread. Loaded in order and warmed in the app's lifespan; a request names
one by `model`, and None means the first."""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from prometheus_client import Counter

from service.batching.batcher import Batcher, Layers, QueueFull, Timings
from service.batching.in_flight import in_flight
from service.engine.canary import CanaryMismatch, CanaryReport, prove
from service.engine.providers import cpu_flags
from service.engine.session import Engine
from service.errors import EngineFailed, Overloaded, ServiceError, TooLarge, UnknownModel
from service.manifest import MANIFEST, verify_files
from service.metrics import Metrics
from service.settings import AMX_WINDOW, Settings, default_batch_tokens, default_window

log = logging.getLogger("elmo.service")
# How ONNX Runtime says an allocation failed (its CPU arena, CUDA's allocator, a C++ bad_alloc)
_ALLOCATION = re.compile(r"Failed to allocate memory for requested buffer of size \d+|bad_alloc|out of memory")


class StartupFailed(RuntimeError):
    """A model cannot be served: the message, one line, names it and says what is wrong (logged where raised;
    the app's start-up reports it without a traceback: service/api/app.py)."""


@dataclass(frozen=True)
class ServedModel:
    """One model in service: its name, folder, engine and batcher (its own queue), and the batch budget and window
    in force."""

    name: str
    folder: Path
    engine: Engine
    batcher: Batcher
    batch_tokens: int
    window: int  # positions a sentence in flight advances per engine call
    created: int  # when its export was written (the manifest's mtime, in seconds): /v1/models' `created`
    canary: CanaryReport  # what its engine's start-up check found (service/engine/canary.py)
    rejected: Counter  # requests refused because its queue was full
    memory: MemoryBound = field(default_factory=lambda: MemoryBound())  # the sentences that never fit, once learned

    @property
    def dim(self) -> int:
        return self.engine.dim

    @property
    def num_layers(self) -> int:
        return self.engine.num_layers

    @property
    def language(self) -> str:
        """Whose Moses rules texts sent to this model are tokenized by (its manifest's)."""
        return self.engine.info.language

    async def embed(
        self, sentences: list[list[str]], client: str, field: str, timings: Timings | None = None
    ) -> list[Layers]:
        """Each sentence's layers, queued on this model's queue in `client`'s turn; Overloaded when the queue is full
        now, EngineFailed when the engine fails on these sentences alone. `timings`: see Batcher.embed."""
        self.memory.check(sentences, field)
        try:
            return await self.batcher.embed(sentences, client, timings)
        except QueueFull as err:  # this model's queue: the other models' are their own
            self.rejected.inc()
            raise Overloaded(f"overloaded: model {self.name}'s {err}; retry later") from None
        except ServiceError as err:  # larger than the queue: about the request's sentences
            err.field = field
            raise
        except Exception as err:
            if (short := _out_of_memory(err)) is not None:
                raise self.memory.learned(self.name, sentences, short, field) from None
            log.exception("engine batch failed")
            raise EngineFailed(f"inference failed ({type(err).__name__}); retry") from None


class MemoryBound:
    """The sentences a model's engine cannot allocate, learned from the first that failed for memory alone (the
    batcher fails a request only for a sentence that failed alone): it would never fit, and 503 "retry" had its
    client retry it, each attempt a traceback and the engine's arena grown again. From then on a sentence as long
    is refused 413 before it reaches the queue, naming the bound, and the log has one line."""

    def __init__(self) -> None:
        self.tokens: int | None = None  # the fewest tokens (with the 2 boundaries) that failed; None: none yet
        self.why = ""

    def check(self, sentences: list[list[str]], field: str) -> None:
        if self.tokens is None:
            return
        for i, sentence in enumerate(sentences):
            if len(sentence) + 2 >= self.tokens:
                raise TooLarge(self._message(len(sentence) + 2), f"{field}[{i}]")

    def learned(self, model: str, sentences: list[list[str]], why: str, field: str) -> TooLarge:
        longest = max(len(s) for s in sentences) + 2  # the batcher runs the longest first: it failed
        self.tokens, self.why = min(longest, self.tokens or longest), why
        log.warning("model %s: a sentence of %d tokens failed alone for memory (%s): sentences of %d tokens or more "
                    "are refused from now on", model, longest, why, self.tokens)  # fmt: skip
        return TooLarge(self._message(longest), field)

    def _message(self, tokens: int) -> str:
        return (
            f"{tokens} tokens with the 2 boundary tokens; this server cannot allocate the memory for a sentence of "
            f"{self.tokens} tokens or more, even alone ({self.why}): the limit is {self.tokens - 1} here (send "
            "shorter sentences; ELMO_MAX_TOKENS_PER_SENTENCE bounds them)"
        )


class ModelRegistry:
    """The models in service, in the order given; the first is the default."""

    def __init__(self, models: list[ServedModel]):
        self._models = {model.name: model for model in models}
        self.default = models[0]

    def __iter__(self) -> Iterator[ServedModel]:
        return iter(self._models.values())

    def __len__(self) -> int:
        return len(self._models)

    @property
    def names(self) -> list[str]:
        return list(self._models)

    def get(self, name: str | None) -> ServedModel:
        """The model a request names (None: the default); UnknownModel otherwise."""
        if name is None:
            return self.default
        try:
            return self._models[name]
        except KeyError:
            raise UnknownModel(name, self.names) from None

    async def start(self) -> None:
        """Start every model's engine thread and warm each with a first batch (its first run allocates)."""
        for model in self:
            model.batcher.start()
        for model in self:
            try:
                await model.batcher.embed([["Warm", "-", "up", "."]])
            except Exception as err:  # its first batch on this machine: a graph that loads but cannot run
                where = f"the model {model.name!r} from {model.folder}"
                message = f"cannot serve {where}: its first batch failed: {_one_line(err)}"
                log.error(message)
                raise StartupFailed(message) from None

    async def stop(self) -> None:
        """Finish what every model has queued and in flight, then stop their engine threads."""
        await asyncio.gather(*(model.batcher.stop() for model in self))


def load_models(settings: Settings, metrics: Metrics) -> ModelRegistry:
    """Every model of `settings.models`, each with an Engine (intra_op_threads each), its rows in flight and a
    Batcher of its own, each engine proven on its export's canaries. A model that cannot be loaded, or whose
    canaries disagree (ELMO_CANARY=refuse), stops the start with StartupFailed naming it and its folder, or the
    figures."""
    served = []
    for name, folder in settings.models:
        try:
            engine = Engine(
                folder,
                settings.provider,
                settings.intra_op_threads,
                settings.inter_op_threads,
                settings.token_cache,
                precision=settings.precision,
                device_id=settings.device_id,
                cuda_graphs=settings.cuda_graphs,
                max_rows=settings.max_rows,
            )
            verify_files(engine.info, engine.graph)  # every file it reads as exported: sha256 (ValueError)
        except Exception as err:  # a corrupt model file, most likely: say so, and never serve half-ready
            message = f"cannot load the model {name!r} from {folder}: {_one_line(err)}"
            log.error(message)
            raise StartupFailed(message) from None
        try:
            report = prove(engine, name, settings.canary, settings.canary_margin)
        except CanaryMismatch as err:
            log.error(str(err))
            raise StartupFailed(str(err)) from None
        except Exception as err:  # a graph that loads but cannot run its canaries
            message = f"cannot serve the model {name!r} from {folder}: its canaries failed: {_one_line(err)}"
            log.error(message)
            raise StartupFailed(message) from None
        metrics.observe_canary(name, report)
        # unset: the provider's default (a GPU wants far more tokens in flight than 2 CPU cores)
        batch_tokens = settings.batch_tokens or default_batch_tokens(engine.provider)
        # the window graph's calls run its own window; the Loop graph's the one set, else the host's
        window = engine.window or settings.window or default_window(cpu_flags())
        if not engine.window and settings.window is None:
            log.info("model %r: a window of %d positions a call (%s AMX)", name, window,
                     "this CPU has" if window == AMX_WINDOW else "no")  # fmt: skip
        batcher = Batcher(
            partial(engine.run, boundaries=True),
            in_flight(engine, window),
            batch_tokens,
            settings.max_wait_ms / 1000,
            settings.queue_tokens,
            on_batch=metrics.batch_observer(name),
            gather_s=settings.gather_ms / 1000,
        )
        created = int((Path(folder) / MANIFEST).stat().st_mtime)
        rejected = metrics.rejected.labels(name)
        served.append(ServedModel(name, Path(folder), engine, batcher, batch_tokens, window, created, report, rejected))
    return ModelRegistry(served)


def _one_line(err: Exception) -> str:
    """An error's type and message on one line (ONNX Runtime's messages may hold line breaks)."""
    return " ".join(f"{type(err).__name__}: {err}".split())


def _out_of_memory(err: Exception) -> str | None:
    """What an engine failure says of memory, if it is an allocation that failed; None otherwise."""
    if isinstance(err, MemoryError):
        return "MemoryError"
    found = _ALLOCATION.search(str(err))
    return found[0] if found else None
