"""Client and AsyncClient of the ELMo embedding service: numpy arrays of exactly the server's shapes, for inputs
of any size. An input is split into requests under the limits the server reports in /info (read once), sent
concurrently up to a bound, and answered in input order. 503 and 429 are retried after `Retry-After` within a
bounded total wait, a request answered 413 is split in halves, a connection that fails (the server went away or
restarts) is retried a few times; everything else the server refuses is raised as ElmoError with its `detail`."""

from __future__ import annotations

import asyncio
import email.utils
import random
import threading
import time
import zipfile
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timezone

import httpx
import numpy as np

from elmo_client import wire
from elmo_client.chunks import Limits, plan, vector_bytes

DEFAULT_URL = "http://127.0.0.1:8000"
RETRIED = (429, 503)  # too many requests, overloaded (or starting, or draining): both say when to come back
DEFAULT_RETRY_AFTER_S = 1.0  # when a 503 or 429 does not say
CONNECT_BACKOFF_S = 0.25  # first wait after a failed connection, doubled each time
# Up to this share of Retry-After is added at random: requests refused together (a full queue refuses many at
# once) then come back spread out, and the engine works through them instead of idling between waves.
RETRY_JITTER = 0.5

Sentence = str | Sequence[str]  # a text the server tokenizes, or tokens


class ElmoError(Exception):
    """The server refused a request: `status` is its HTTP status and `detail` its explanation
    (e.g. "sentences[3]: 1200 tokens; the limit is 1000")."""

    def __init__(self, message: str, status: int | None = None, detail: object = None):
        super().__init__(message)
        self.status, self.detail = status, detail


class ElmoConnectionError(ElmoError):
    """The server could not be reached, or the connection broke, on every try."""


@dataclass(frozen=True)
class Embedding:
    """One sentence's answer: its vectors and the tokens they belong to."""

    embedding: np.ndarray
    tokens: list[str]
    truncated: bool = False  # with truncate=True: the sentence was cut to the server's limit
    original_tokens: int | None = None  # with truncate=True: its tokens before the cut


def _retry_after(response: httpx.Response) -> float:
    value = response.headers.get("retry-after", "").strip()
    if value.isdigit():
        return float(value)
    try:  # the other form HTTP allows: a date
        when = email.utils.parsedate_to_datetime(value)
        return max(0.0, (when - datetime.now(timezone.utc)).total_seconds())
    except (TypeError, ValueError):
        return DEFAULT_RETRY_AFTER_S


def _checked_url(url: str) -> str:
    """The service's URL without a trailing slash; one that is not http(s)://host... is refused at once (httpx would
    try "localhost:8000" as a URL of scheme "localhost", and every retry would fail the same way)."""
    parsed = httpx.URL(url)
    if parsed.scheme not in ("http", "https") or not parsed.host:
        example = url.split("://")[-1] or DEFAULT_URL.split("://")[-1]
        raise ValueError(f"url {url!r}: give the scheme and the host, e.g. http://{example}")
    return url.rstrip("/")


def _error(response: httpx.Response, note: str = "") -> ElmoError:
    try:
        body = response.json()
        detail = body.get("detail") or (body.get("error") or {}).get("message")  # the service's, or /v1/*'s
    except (ValueError, AttributeError):
        detail = response.text[:500]
    where = f"{response.request.method} {response.request.url.path}"
    return ElmoError(f"{where}: {response.status_code} {detail}{note}", response.status_code, detail)


class _Attempts:
    """When one request is sent again. 503 and 429: after `Retry-After` (and up to half as long again, at
    random), while the waits add up to at most `wait_s`. A failed connection: after 0.25 s, 0.5 s, ... at most
    `connect_retries` times (an embedding is the same whenever it is computed, so sending it twice is safe).
    A timeout is not retried: the server may be busy with it still."""

    def __init__(self, wait_s: float, connect_retries: int):
        self.wait_s, self.connect_retries = wait_s, connect_retries
        self.waited, self.failures = 0.0, 0

    def after_response(self, response: httpx.Response) -> float | None:
        """None: the response is the answer; else the seconds to wait before sending again."""
        if response.status_code not in RETRIED:
            return None
        delay = _retry_after(response) * (1 + RETRY_JITTER * random.random())
        if self.waited + delay > self.wait_s:
            raise _error(response, f" (gave up after waiting {self.waited:.1f} s in all)")
        self.waited += delay
        return delay

    def after_failure(self, error: httpx.TransportError, url: str) -> float:
        if isinstance(error, httpx.TimeoutException):
            raise ElmoError(f"{url}: no answer within the timeout ({type(error).__name__})") from error
        self.failures += 1
        delay = CONNECT_BACKOFF_S * 2 ** (self.failures - 1)
        if self.failures > self.connect_retries or self.waited + delay > self.wait_s:
            raise ElmoConnectionError(
                f"{url}: cannot reach the server ({type(error).__name__}: {error}) after {self.failures} tries"
            ) from error
        self.waited += delay
        return delay


def _options(**given) -> dict:
    # Only what the caller set: the server's defaults and its checks apply to the rest (it refuses `gamma`
    # with output="layers", say, rather than the client guessing).
    return {name: value for name, value in given.items() if value is not None}


def _json(response: httpx.Response) -> dict:
    if response.is_error:
        raise _error(response)
    return response.json()


def _answer(response: httpx.Response) -> dict:
    if response.is_error:
        raise _error(response)
    kind = response.headers.get("content-type", wire.JSON)
    try:
        return wire.answer(response.content, kind)
    except (ValueError, KeyError, OSError, zipfile.BadZipFile) as err:  # a body cut short or not what it says
        raise ElmoError(f"{response.url}: unreadable {kind} answer ({type(err).__name__}: {err})") from err


def _items(data: list[dict], expected: int) -> list[dict]:
    if [item.get("index") for item in data] != list(range(expected)):
        raise ElmoError(f"the server answered {len(data)} items for {expected} sentences")
    return data


def _embedding(item: dict) -> Embedding:
    return Embedding(wire.decode(item), item["tokens"], item.get("truncated", False), item.get("original_tokens"))


class _Base:
    """What the two clients share: settings, the plan of requests, and the answers' decoding."""

    def __init__(
        self,
        url: str | None,
        api_key: str | None,
        max_concurrency: int,
        retry_wait_s: float,
        connect_retries: int,
    ):
        if max_concurrency < 1:
            raise ValueError("max_concurrency must be at least 1")
        self.url = _checked_url(url or DEFAULT_URL)
        self.max_concurrency, self.retry_wait_s, self.connect_retries = max_concurrency, retry_wait_s, connect_retries
        self._headers = {"content-type": "application/json", "user-agent": "elmo-client/0.1"}
        if api_key:
            self._headers["authorization"] = f"Bearer {api_key}"
        self._info: dict | None = None

    def _accept(self, path: str) -> str:
        return wire.accept(self._info or {}, path)

    def _attempts(self) -> _Attempts:
        return _Attempts(self.retry_wait_s, self.connect_retries)

    def _model_info(self, model: str | None) -> dict:
        """/info as it concerns `model` (None: the server's default, /info's top level): its dim, num_layers and
        limits from /info's `models`, where the server lists them (a server before several models does not)."""
        info = self._info or {}
        own = (info.get("models") or {}).get(model) if model is not None else None
        if not own:
            return info
        limits = {**info.get("limits", {}), **{k: own[k] for k in ("queue_tokens", "batch_tokens") if k in own}}
        return {**info, **{k: own[k] for k in ("dim", "num_layers") if k in own}, "limits": limits}

    def _runs(self, sentences: list, options: dict, path: str) -> list[range]:
        info = self._model_info(options.get("model"))
        limits = Limits.from_info(info)
        body = wire.embed_body if path == "/embed" else wire.tokenize_body
        # Each of the requests in flight together must fit in the server's queue at once.
        tokens_per_request = max(1, limits.queue_tokens // self.max_concurrency)
        # The answer too must fit the server's limit (texts are counted by their words: Moses may make more,
        # and a request whose answer turns out too large is answered 413 and split).
        vector = vector_bytes(info, options, wire.ENCODING) if path == "/embed" else 0.0
        truncate, pooled = bool(options.get("truncate")), options.get("pooling") == "mean"
        answered = 2 if options.get("boundaries") else 0  # positions a sentence's answer has beyond its tokens
        return plan(sentences, limits, len(body([], options)), tokens_per_request, truncate, vector, pooled, answered)

    @staticmethod
    def _sentences(sentences) -> list:
        if isinstance(sentences, str):
            raise TypeError("sentences: a list of sentences (each a string or a list of tokens), not one string")
        return [s if isinstance(s, str) else list(s) for s in sentences]


class Client(_Base):
    """A client of one ELMo service. Thread-safe; close it (or use `with`) to close its connections.

    url: the service (default http://127.0.0.1:8000); api_key: sent as `Authorization: Bearer`;
    timeout: seconds for one request; max_concurrency: requests in flight at once (its connections: calls from
    several threads share them, and wait for one rather than time out);
    retry_wait_s: the most one request waits in all for 503 and 429 retries; connect_retries: how often a
    failed connection is retried before ElmoConnectionError."""

    def __init__(
        self,
        url: str | None = None,
        api_key: str | None = None,
        timeout: float = 60.0,
        *,
        max_concurrency: int = 4,
        retry_wait_s: float = 60.0,
        connect_retries: int = 3,
    ):
        super().__init__(url, api_key, max_concurrency, retry_wait_s, connect_retries)
        limits = httpx.Limits(max_connections=max_concurrency, max_keepalive_connections=max_concurrency)
        timeouts = httpx.Timeout(timeout, pool=None)  # waiting for a free connection is queueing, not failure
        self._http = httpx.Client(base_url=self.url, headers=self._headers, timeout=timeouts, limits=limits)
        self._info_lock = threading.Lock()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def info(self) -> dict:
        """The server's /info (model, dim, num_layers, limits, settings; `models`: each model served), read once."""
        with self._info_lock:
            if self._info is None:
                self._info = _json(self._request("GET", "/info"))
            return self._info

    def models(self) -> list[dict]:
        """The models the server serves, the default first (/v1/models' `data`: `id`, `dim`, `num_layers`, ...)."""
        return _json(self._request("GET", "/v1/models"))["data"]

    @property
    def num_layers(self) -> int:
        return int(self.info()["num_layers"])

    @property
    def dim(self) -> int:
        return int(self.info()["dim"])

    def embed(
        self,
        sentences: Sequence[Sentence],
        *,
        output: str | None = None,
        weights: Sequence[float] | None = None,
        gamma: float | None = None,
        normalize: str | None = None,
        layer_norm: bool | None = None,
        layers: Sequence[int] | None = None,
        pooling: str | None = None,
        mixes: Sequence[dict] | None = None,
        unit_length: bool | None = None,
        truncate: bool | None = None,
        model: str | None = None,
        dtype: str | None = None,
        boundaries: bool | None = None,
    ) -> list[np.ndarray]:
        """One float32 array per sentence, of the server's shape: mix (n_tokens, dim), output="layers"
        (len(layers), n_tokens, dim), mixes (n_mixes, n_tokens, dim); pooling="mean" drops the token axis.
        Options left None take the server's defaults (see the /embed table of the README); `model`: one of the
        server's models (`models()`), None: its default; `dtype="float16"`: float16 arrays, half the bytes over
        the wire (each number rounded once by the server); `boundaries=True`: the sentence boundaries' vectors
        too, first and last (n_tokens + 2 positions; an empty sentence is then its two boundaries)."""
        options = _options(
            output=output, weights=weights, gamma=gamma, normalize=normalize, layer_norm=layer_norm,
            layers=layers, pooling=pooling, mixes=mixes, unit_length=unit_length, truncate=truncate, model=model,
            dtype=dtype, boundaries=boundaries,
        )  # fmt: skip
        return [item.embedding for item in self.embed_items(sentences, **options)]

    def embed_items(self, sentences: Sequence[Sentence], **options) -> list[Embedding]:
        """As `embed`, with each sentence's tokens (as the server read them) and what `truncate` cut."""
        return [_embedding(item) for item in self._all("/embed", self._sentences(sentences), _options(**options))]

    def tokenize(
        self, sentences: Sequence[Sentence], *, truncate: bool | None = None, model: str | None = None
    ) -> list[dict]:
        """The server's /tokenize item of each sentence: tokens, utf8_bytes, kept_bytes, truncated, original_tokens."""
        return self._all("/tokenize", self._sentences(sentences), _options(truncate=truncate, model=model))

    def _all(self, path: str, sentences: list, options: dict) -> list[dict]:
        if not sentences:
            return []
        self.info()
        runs = self._runs(sentences, options, path)
        if len(runs) == 1:
            return self._answer(path, sentences, options)
        with ThreadPoolExecutor(min(self.max_concurrency, len(runs)), thread_name_prefix="elmo-client") as pool:
            futures = [pool.submit(self._answer, path, sentences[r.start : r.stop], options) for r in runs]
            try:
                return [item for future in futures for item in future.result()]
            except BaseException:
                for future in futures:
                    future.cancel()
                raise

    def _answer(self, path: str, sentences: list, options: dict) -> list[dict]:
        """The items of one run of sentences: split in halves for as long as the server answers 413."""
        body = (wire.embed_body if path == "/embed" else wire.tokenize_body)(sentences, options)
        response = self._request("POST", path, body, self._accept(path))
        if response.status_code == 413 and len(sentences) > 1:
            half = len(sentences) // 2
            return self._answer(path, sentences[:half], options) + self._answer(path, sentences[half:], options)
        return _items(_answer(response)["data"], len(sentences))

    def _request(self, method: str, path: str, body: bytes | None = None, accept: str = wire.JSON) -> httpx.Response:
        attempts = self._attempts()
        while True:
            try:
                response = self._http.request(method, path, content=body, headers={"accept": accept})
            except httpx.TransportError as err:
                time.sleep(attempts.after_failure(err, f"{self.url}{path}"))
                continue
            delay = attempts.after_response(response)
            if delay is None:
                return response
            time.sleep(delay)


class AsyncClient(_Base):
    """Client's twin for asyncio: the same arguments and methods, awaited (`aclose`, `async with`)."""

    def __init__(
        self,
        url: str | None = None,
        api_key: str | None = None,
        timeout: float = 60.0,
        *,
        max_concurrency: int = 4,
        retry_wait_s: float = 60.0,
        connect_retries: int = 3,
    ):
        super().__init__(url, api_key, max_concurrency, retry_wait_s, connect_retries)
        limits = httpx.Limits(max_connections=max_concurrency, max_keepalive_connections=max_concurrency)
        timeouts = httpx.Timeout(timeout, pool=None)
        self._http = httpx.AsyncClient(base_url=self.url, headers=self._headers, timeout=timeouts, limits=limits)
        self._slots: asyncio.Semaphore | None = None  # made in the event loop that uses it

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def info(self) -> dict:
        """As Client.info."""
        if self._info is None:
            self._info = _json(await self._request("GET", "/info"))
        return self._info

    async def models(self) -> list[dict]:
        """As Client.models."""
        return _json(await self._request("GET", "/v1/models"))["data"]

    async def embed(
        self,
        sentences: Sequence[Sentence],
        *,
        output: str | None = None,
        weights: Sequence[float] | None = None,
        gamma: float | None = None,
        normalize: str | None = None,
        layer_norm: bool | None = None,
        layers: Sequence[int] | None = None,
        pooling: str | None = None,
        mixes: Sequence[dict] | None = None,
        unit_length: bool | None = None,
        truncate: bool | None = None,
        model: str | None = None,
        dtype: str | None = None,
        boundaries: bool | None = None,
    ) -> list[np.ndarray]:
        """As Client.embed."""
        options = _options(
            output=output, weights=weights, gamma=gamma, normalize=normalize, layer_norm=layer_norm,
            layers=layers, pooling=pooling, mixes=mixes, unit_length=unit_length, truncate=truncate, model=model,
            dtype=dtype, boundaries=boundaries,
        )  # fmt: skip
        return [item.embedding for item in await self.embed_items(sentences, **options)]

    async def embed_items(self, sentences: Sequence[Sentence], **options) -> list[Embedding]:
        items = await self._all("/embed", self._sentences(sentences), _options(**options))
        return [_embedding(item) for item in items]

    async def tokenize(
        self, sentences: Sequence[Sentence], *, truncate: bool | None = None, model: str | None = None
    ) -> list[dict]:
        return await self._all("/tokenize", self._sentences(sentences), _options(truncate=truncate, model=model))

    async def _all(self, path: str, sentences: list, options: dict) -> list[dict]:
        if not sentences:
            return []
        await self.info()
        runs = self._runs(sentences, options, path)
        tasks = [asyncio.ensure_future(self._answer(path, sentences[r.start : r.stop], options)) for r in runs]
        try:
            answers = await asyncio.gather(*tasks)
        except BaseException:
            for task in tasks:
                task.cancel()
            raise
        return [item for items in answers for item in items]

    async def _answer(self, path: str, sentences: list, options: dict) -> list[dict]:
        body = (wire.embed_body if path == "/embed" else wire.tokenize_body)(sentences, options)
        response = await self._request("POST", path, body, self._accept(path))
        if response.status_code == 413 and len(sentences) > 1:
            half = len(sentences) // 2
            first = await self._answer(path, sentences[:half], options)
            return first + await self._answer(path, sentences[half:], options)
        return _items(_answer(response)["data"], len(sentences))

    async def _request(
        self, method: str, path: str, body: bytes | None = None, accept: str = wire.JSON
    ) -> httpx.Response:
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.max_concurrency)
        attempts = self._attempts()
        while True:
            try:
                async with self._slots:  # at most max_concurrency requests in flight; none held while waiting
                    response = await self._http.request(method, path, content=body, headers={"accept": accept})
            except httpx.TransportError as err:
                await asyncio.sleep(attempts.after_failure(err, f"{self.url}{path}"))
                continue
            delay = attempts.after_response(response)
            if delay is None:
                return response
            await asyncio.sleep(delay)
