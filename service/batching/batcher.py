"""Dynamic batching: many concurrent requests share the engine. The batcher is the event loop's side of it: a
request's sentences go into the queue, whose policy (the clients' turns, the token budgets, push-out: which
requests wait, which are refused, which sentences join the next window) is service/batching/queue.py, and come back
as the engine's thread (service/batching/engine_thread.py: continuous batching over the sentences in flight, and the
retries of a failed window) answers them.

* A request that does not fit the queue is refused at once (`QueueFull`: 503 with Retry-After), one larger than the
  whole queue with `LargerThanQueue` (413); a full queue is shared fairly between the clients (push-out).
* Sentences whose client has gone are dropped before they cost compute: from the queue at once, and from
  flight before the next window.
* The event loop never waits for the engine, and every request gets exactly its own rows back, in its order.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

from service.batching.engine_thread import BatchStats, EngineRun, EngineThread, Layers
from service.batching.in_flight import InFlight, PackedInFlight
from service.batching.queue import Entry, LargerThanQueue, Queue, QueueFull, Timings

__all__ = ["BatchStats", "Batcher", "LargerThanQueue", "Layers", "QueueFull", "Timings"]


class Batcher:
    def __init__(
        self,
        run: EngineRun,
        in_flight: InFlight | PackedInFlight,
        batch_tokens: int,
        max_wait_s: float,
        queue_tokens: int,
        on_batch: Callable[[BatchStats], None] | None = None,
        gather_s: float = 0.0,
        overlap: bool = True,
    ):
        self._in_flight = in_flight
        self.batch_tokens = batch_tokens
        self.max_wait_s = max_wait_s
        self.gather_s = gather_s
        self.queue_tokens = queue_tokens
        self._cond = threading.Condition()  # guards the queue and the engine thread's `stopping`
        self._queue = Queue(queue_tokens)
        in_flight.overlap(overlap)  # the window graph: each call prepared while the one before runs
        self._engine = EngineThread(run, in_flight, self._queue, self._cond, batch_tokens, max_wait_s, gather_s,
                                    on_batch or (lambda stats: None))  # fmt: skip

    @property
    def queued_tokens(self) -> int:
        return self._queue.tokens

    @property
    def busy(self) -> bool:
        """An engine call is running."""
        return self._engine.busy

    def start(self) -> None:
        self._engine.start(asyncio.get_running_loop())

    async def stop(self) -> None:
        """Finish everything queued and in flight, then stop the engine thread."""
        with self._cond:
            self._engine.stopping = True
            self._cond.notify()
        await asyncio.to_thread(self._engine.join)

    async def embed(self, sentences: list[list[str]], client: str = "", timings: Timings | None = None) -> list[Layers]:
        """Each sentence's layers (`result()`: (num_layers, n_tokens, dim)), put together by the caller where it
        uses them (a large request's, off the event loop). Raises QueueFull when the queue is full now,
        LargerThanQueue when the request alone is over the queue's size. `client` names whose turn its sentences wait
        for; `timings`, if given, gets when they were queued, started and answered. Cancelling the awaiting task (the
        client went away) takes the request out of the queue and of flight."""
        if not sentences:  # no rows would ever resolve its future
            return []
        entry = Entry(sentences, asyncio.get_running_loop().create_future(), client, timings=timings)
        if timings is not None:
            timings.queued = entry.enqueued
        with self._cond:
            pushed_out = self._queue.push(entry)  # or LargerThanQueue, QueueFull
            self._cond.notify()
        for victim, error in pushed_out:
            victim.future.set_exception(error)
        try:
            return await entry.future
        finally:
            entry.gone = True  # answered, failed or cancelled: whatever of it is left costs no more compute
            if entry.waiting:
                with self._cond:
                    self._queue.drop(entry)
