"""Dynamic batching: many concurrent requests become few large engine batches. Owns the policy, nothing else.

* Each request's sentences enter the queue as one entry; the queue is bounded in tokens, and a request
  that does not fit is refused at once (`QueueFull` -> 503 with Retry-After), never left to pile up; one
  larger than the whole queue could never fit (`TooLarge` -> 413).
* The batching loop runs whenever the engine is free: it waits at most `max_wait` for more work while the
  queue holds less than a batch (after a round that answered several clients, up to `gather` for them to
  send again), then takes every waiting sentence, sorts them by length (little padding)
  and cuts them into batches whose padded size (rows x longest, boundary tokens included) stays within
  the token budget. A request larger than a batch is simply spread over several.
* Entries whose client has gone are dropped before they cost compute.
* A batch the engine fails on (out of memory, say) is run again in halves, down to single sentences, so
  only a request whose own sentence fails alone gets the error.
* The engine runs in a worker thread, so the event loop keeps serving while a batch computes, and every
  request gets exactly its own rows back.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

EngineRun = Callable[[Sequence[Sequence[str]]], list[np.ndarray]]
log = logging.getLogger("elmo.batcher")


class QueueFull(Exception):
    """The queue cannot take this request now; the client should retry later."""


class TooLarge(Exception):
    """The request is larger than the whole queue: it can never be taken, so retrying is no use."""

    def __init__(self, tokens: int, limit: int):
        super().__init__(
            f"{tokens} tokens with 2 boundary tokens per sentence; the limit is {limit} per request (the queue size)"
        )


@dataclass(eq=False)
class _Entry:
    sentences: list[list[str]]
    future: asyncio.Future
    enqueued: float = field(default_factory=time.perf_counter)

    def __post_init__(self) -> None:
        self.tokens = sum(len(s) + 2 for s in self.sentences)  # what it costs the queue, boundaries included
        self.results: list[np.ndarray | None] = [None] * len(self.sentences)
        self.pending = len(self.sentences)  # sentences not computed yet


@dataclass
class BatchStats:
    """What one engine batch was, for the metrics."""

    sentences: int
    padded_tokens: int
    real_tokens: int
    seconds: float
    queue_seconds: list[float]


class Batcher:
    def __init__(
        self,
        run: EngineRun,
        batch_tokens: int,
        max_wait_s: float,
        queue_tokens: int,
        on_batch: Callable[[BatchStats], None] | None = None,
        gather_s: float = 0.0,
    ):
        self._run = run
        self.batch_tokens = batch_tokens
        self.max_wait_s = max_wait_s
        self.gather_s = gather_s
        self._expected = 0  # requests expected back after the last round (0: do not wait for them)
        self._gather_until = 0.0
        self.queue_tokens = queue_tokens
        self._on_batch = on_batch
        self._queue: list[_Entry] = []
        self._queued_tokens = 0
        self._wakeup = asyncio.Event()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
        self._task: asyncio.Task | None = None
        self.busy = False

    @property
    def queued_tokens(self) -> int:
        return self._queued_tokens

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="batcher")

    async def stop(self) -> None:
        """Finish everything queued, then stop the loop."""
        while self._queue or self.busy:
            await asyncio.sleep(0.01)
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._executor.shutdown(wait=True)

    async def embed(self, sentences: list[list[str]]) -> list[np.ndarray]:
        """Each sentence's layers (num_layers, n_tokens, dim). Raises QueueFull when the queue is full now,
        TooLarge when the request alone is over the queue's size.
        Cancelling the awaiting task (the client went away) takes the request out of the queue."""
        if not sentences:  # no rows would ever resolve its future
            return []
        entry = _Entry(sentences, asyncio.get_running_loop().create_future())
        if entry.tokens > self.queue_tokens:
            raise TooLarge(entry.tokens, self.queue_tokens)
        if self._queued_tokens + entry.tokens > self.queue_tokens:
            raise QueueFull(f"queue holds {self._queued_tokens} of {self.queue_tokens} tokens")
        self._queue.append(entry)
        self._queued_tokens += entry.tokens
        self._wakeup.set()
        try:
            return await entry.future
        finally:
            if entry in self._queue:  # cancelled before it ran: leave nothing behind
                self._queue.remove(entry)
                self._queued_tokens -= entry.tokens

    async def _loop(self) -> None:
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            if not self._queue:
                continue
            await self._gather()
            entries = [e for e in self._queue if not e.future.done()]
            self._queue.clear()
            self._queued_tokens = 0
            if entries:
                answered_last = await self._process(entries)
                # Clients just answered tend to send again: after a round that answered several requests,
                # wait (at most `gather`) for those of its last batch too (the others had time to come back),
                # so N steady concurrent clients share one batch of N instead of settling into alternating
                # smaller batches (measured: half the batch, -25% tokens/s).
                if len(entries) > 1:
                    self._expected = len(self._queue) + answered_last
                    self._gather_until = time.perf_counter() + self.gather_s
            if self._queue:
                self._wakeup.set()

    async def _gather(self) -> None:
        """Wait for more work while the queue holds less than a batch: until `max_wait` after the oldest
        entry, and after a round of several requests, until as many are back (at most `gather`)."""
        deadline = self._queue[0].enqueued + self.max_wait_s
        expected, self._expected = self._expected, 0
        if expected:
            deadline = max(deadline, self._gather_until)
        while self._queued_tokens < self.batch_tokens and (wait := deadline - time.perf_counter()) > 0:
            if expected and len(self._queue) >= expected:
                return
            try:
                await asyncio.wait_for(self._wakeup.wait(), wait)
                self._wakeup.clear()
            except asyncio.TimeoutError:  # not the builtin TimeoutError before Python 3.11
                return

    async def _process(self, entries: list[_Entry]) -> int:
        """Run the entries in length-sorted batches; returns how many requests the last batch completed."""
        answered = 0
        items = [(e, i) for e in entries for i in range(len(e.sentences))]
        items.sort(key=lambda item: len(item[0].sentences[item[1]]), reverse=True)
        start = 0
        while start < len(items):
            longest = len(items[start][0].sentences[items[start][1]]) + 2
            rows = max(1, self.batch_tokens // longest)
            batch = [item for item in items[start : start + rows] if not item[0].future.done()]
            start += rows
            if batch:
                answered = await self._run_batch(batch, longest)
        return answered

    async def _run_batch(self, batch: list[tuple[_Entry, int]], longest: int) -> int:
        """Run one batch and hand out its rows; returns how many requests it completed. If the engine fails
        on it (out of memory, say), its halves are run, and theirs, down to single sentences: only a sentence
        that fails alone fails its request, everyone else is answered, and the server keeps serving."""
        sentences = [entry.sentences[i] for entry, i in batch]
        now = time.perf_counter()
        self.busy = True
        try:
            layers = await asyncio.get_running_loop().run_in_executor(self._executor, self._run, sentences)
        except Exception as err:
            failure = err
        else:
            failure = None
        finally:
            self.busy = False
        if failure is not None:
            return await self._after_failure(batch, failure)
        answered = 0
        for (entry, i), array in zip(batch, layers, strict=True):
            if entry.future.done():
                continue
            entry.results[i] = array
            entry.pending -= 1
            if entry.pending == 0:
                entry.future.set_result(entry.results)
                answered += 1
        if self._on_batch:
            self._on_batch(
                BatchStats(
                    sentences=len(batch),
                    padded_tokens=len(batch) * longest,
                    real_tokens=sum(len(s) for s in sentences),
                    seconds=time.perf_counter() - now,
                    queue_seconds=[now - entry.enqueued for entry, _ in batch],
                )
            )
        return answered

    async def _after_failure(self, batch: list[tuple[_Entry, int]], err: Exception) -> int:
        if len(batch) == 1:
            entry = batch[0][0]
            if entry.future.done():
                return 0
            log.warning("engine failed on a single sentence (%s): failing its request", type(err).__name__)
            entry.future.set_exception(err)
            return 1
        log.warning(
            "engine failed on a batch of %d sentences (%s): running it in halves", len(batch), type(err).__name__
        )
        answered = 0
        for half in (batch[: len(batch) // 2], batch[len(batch) // 2 :]):
            wanted = [(entry, i) for entry, i in half if not entry.future.done()]
            if wanted:  # length-sorted: the first sentence is the longest
                answered += await self._run_batch(wanted, len(wanted[0][0].sentences[wanted[0][1]]) + 2)
        return answered
