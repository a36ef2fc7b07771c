"""Dynamic batching: many concurrent requests share the engine. The policy (the queue and its turns, the token
budgets, which sentences join the next window) and the engine thread that applies it, with its retries:

* Each request's sentences wait in a queue bounded in tokens: a request that does not fit is refused at once
  (`QueueFull`: 503 with Retry-After), never left to pile up; one larger than the whole queue could never fit
  (`LargerThanQueue`: 413). The queue is one FIFO per client (its address), taken from in turns (service/turns.py), a
  sentence of each at a time: a client that sends many long requests at once delays another's small one by a
  sentence of its own, not by all of them (one client on 4 connections pushed a small request's median to 7 s).
* A full queue is shared fairly: a client within its share (the queue's size over the clients waiting, itself
  included) that does not fit pushes out the newest waiting requests of the client holding the most, which get
  the QueueFull instead; a client over its share gets it itself. So one address's flood fills its own share and
  gets the 503s, and another's request is taken (longest queue drop); a client alone may fill the whole queue.
* One engine thread runs continuous batching (service/batching/in_flight.py): every call advances each sentence in
  flight by a window of positions, and between calls finished sentences are answered and waiting ones join,
  in queue order, as long as the tokens in flight stay within the token budget (at least one sentence always
  runs, however long). An idle engine first waits up to `max_wait` for company; after a window that answered
  clients, the next one waits up to `gather` for them to send again; a window ends early where a sentence
  ends (see `_window_length`). A request larger than the budget is simply spread over time.
* Sentences whose client has gone are dropped before they cost compute: from the queue at once, and from
  flight before the next window.
* A window the engine fails on (out of memory, say) takes its sentences out of flight; they are run again
  whole, in halves, down to single sentences, so only a request whose own sentence fails alone gets the
  error, everyone else is answered, and the server keeps serving.
* On the window graph (a GPU's), the host's side of a call overlaps the call before it: while the engine thread
  waits for call N, another thread takes the sentences that fit the budget from the queue (the turns and budget
  as above, the sentences N finishes no longer counted) and builds call N+1's feeds (char ids, packing, token
  cache). A sentence queued after that, which call N+1 has room for, makes the engine thread build N+1 again
  before it runs, so a newcomer never waits an extra call; under load the call is full and nothing is rebuilt.
* The event loop never waits for the engine, and every request gets exactly its own rows back, in its order.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from service.batching.in_flight import InFlight
from service.errors import Overloaded, TooLarge
from service.turns import Turns

# Whole sentences' layers with their boundary positions (Engine.run with boundaries=True): what a retry computes
EngineRun = Callable[[Sequence[Sequence[str]]], list[np.ndarray]]
log = logging.getLogger("elmo.batcher")


class Layers(Protocol):
    """A sentence's layers, put together when asked for (`result()`: (num_layers, n_tokens, dim) float32;
    `result(boundaries=True)`: with the boundary positions, n_tokens + 2)."""

    def result(self, boundaries: bool = False) -> np.ndarray: ...


class Computed:
    """Layers computed whole (a retry's `engine.run`, boundaries included), given as the rows in flight give theirs."""

    __slots__ = ("array",)

    def __init__(self, array: np.ndarray):
        self.array = array

    def result(self, boundaries: bool = False) -> np.ndarray:
        return self.array if boundaries else np.ascontiguousarray(self.array[:, 1:-1])


class QueueFull(Overloaded):
    """The queue cannot take this request now; the client should retry later."""


class LargerThanQueue(TooLarge):
    """The request is larger than the whole queue: it can never be taken, so retrying is no use."""

    def __init__(self, tokens: int, limit: int, field: str | None = None, at_least: bool = False):
        counted = f"at least {tokens}" if at_least else str(tokens)
        super().__init__(
            f"{counted} tokens with 2 boundary tokens per sentence; the limit is {limit} per request (the queue size)",
            field,
        )


@dataclass
class Timings:
    """When a request's sentences were queued, when the first of them joined those in flight, and when the last was
    answered (time.perf_counter() seconds): its wait in the queue and its time in the engine, for tracing."""

    queued: float = 0.0
    started: float | None = None
    answered: float | None = None


@dataclass(eq=False)
class _Entry:
    """One request. `gone` is set on the event loop once it is answered, failed or cancelled; the engine
    thread only reads it."""

    sentences: list[list[str]]
    future: asyncio.Future
    client: str = ""
    enqueued: float = field(default_factory=time.perf_counter)
    gone: bool = False
    timings: Timings | None = None  # filled in when the caller asks (a traced request)

    def __post_init__(self) -> None:
        self.tokens = sum(len(s) + 2 for s in self.sentences)  # what it costs the queue, boundaries included
        self.results: list[Layers | None] = [None] * len(self.sentences)
        self.pending = len(self.sentences)  # sentences not answered yet
        self.waiting = len(self.sentences)  # sentences still in the queue
        self.unfinished = len(self.sentences)  # sentences not finished in flight (engine thread only)


Item = tuple[_Entry, int]  # a request and the index of one of its sentences


def _tokens(item: Item) -> int:
    return len(item[0].sentences[item[1]]) + 2


@dataclass
class BatchStats:
    """What one engine call was, for the metrics: a window over the sentences in flight (or a retry)."""

    sentences: int
    padded_tokens: int  # positions computed, padding included (the Loop graph's: rows x the longest window)
    real_tokens: int  # the sentences' own positions, boundary tokens included
    seconds: float
    queue_seconds: list[float]  # of the sentences that joined with it


class Batcher:
    def __init__(
        self,
        run: EngineRun,
        in_flight: InFlight,
        batch_tokens: int,
        max_wait_s: float,
        queue_tokens: int,
        on_batch: Callable[[BatchStats], None] | None = None,
        gather_s: float = 0.0,
        overlap: bool = True,
    ):
        self._run = run  # whole sentences (boundaries included), for the retries after a failed window
        self._in_flight = in_flight
        self.batch_tokens = batch_tokens
        self.max_wait_s = max_wait_s
        self.gather_s = gather_s
        self._answered = 0  # requests the last window completed
        self.queue_tokens = queue_tokens
        self._on_batch = on_batch or (lambda stats: None)
        self._cond = threading.Condition()  # guards the queue, its counts and `_stopping`
        self._queue = _Queue()
        self._queued_tokens = 0
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.busy = False  # an engine call is running
        self._joined_ahead: list[Item] = []  # taken while the last call ran (`_intake`), counted with the next one
        if overlap and hasattr(in_flight, "overlap"):  # the window graph's packed rows
            in_flight.overlap(self._intake)

    @property
    def queued_tokens(self) -> int:
        return self._queued_tokens

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._work, name="engine", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        """Finish everything queued and in flight, then stop the engine thread."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread:
            await asyncio.to_thread(self._thread.join)

    async def embed(self, sentences: list[list[str]], client: str = "", timings: Timings | None = None) -> list[Layers]:
        """Each sentence's layers (`result()`: (num_layers, n_tokens, dim)), put together by the caller where it
        uses them (a large request's, off the event loop). Raises QueueFull when the queue is full now,
        LargerThanQueue when the request alone is over the queue's size. `client` names whose turn its sentences wait
        for; `timings`, if given, gets when they were queued, started and answered. Cancelling the awaiting task (the
        client went away) takes the request out of the queue and of flight."""
        if not sentences:  # no rows would ever resolve its future
            return []
        entry = _Entry(sentences, asyncio.get_running_loop().create_future(), client, timings=timings)
        if timings is not None:
            timings.queued = entry.enqueued
        if entry.tokens > self.queue_tokens:
            raise LargerThanQueue(entry.tokens, self.queue_tokens)
        with self._cond:
            if self._queued_tokens + entry.tokens > self.queue_tokens:
                self._push_out(client, entry.tokens)  # or QueueFull
            self._queue.extend(client, ((entry, i) for i in range(len(sentences))))
            self._queued_tokens += entry.tokens
            self._cond.notify()
        try:
            return await entry.future
        finally:
            entry.gone = True  # answered, failed or cancelled: whatever of it is left costs no more compute
            if entry.waiting:
                with self._cond:  # one pass over its client's queue, however many of its sentences wait
                    self._queued_tokens -= self._queue.drop(entry)
                    entry.waiting = 0

    def _push_out(self, client: str, tokens: int) -> None:
        """Make room for `tokens` of `client` in the full queue by refusing the newest waiting requests of the
        clients holding the most, if `client` stays within its share; QueueFull otherwise (called on the event
        loop, with the lock held)."""
        held = self._queue.held.by_address
        mine = held.get(client, 0)
        share = self.queue_tokens // (len(held) + (client not in held))
        full = f"queue holds {self._queued_tokens} of {self.queue_tokens} tokens"
        if mine + tokens > share:
            raise QueueFull(f"{full}, {mine} of them from your address, whose share is {share} now")
        need, others, victims = self._queued_tokens + tokens - self.queue_tokens, dict(held), []
        others.pop(client, None)
        while need > 0 and others:
            most = max(others, key=others.__getitem__)
            victim = self._queue.newest_whole(most, len([v for v in victims if v.client == most]))
            if victim is None or others[most] <= share:
                del others[most]  # nothing of it may go: the next largest
                continue
            victims.append(victim)
            others[most] -= victim.tokens
            need -= victim.tokens
        if need > 0:
            raise QueueFull(f"{full}, and no request of another client above its share ({share}) waits whole")
        for victim in victims:
            self._queued_tokens -= self._queue.drop(victim)
            victim.waiting = 0
            victim.future.set_exception(
                QueueFull(f"{full}: your address held more than its share ({share}) when another's request came")
            )

    # ---- the engine thread -------------------------------------------------------------------------------

    def _work(self) -> None:
        while True:
            self._in_flight.drop(lambda row: row.tag[0].gone)  # before taking: they free budget
            with self._cond:
                while not self._queue and not self._in_flight.busy:
                    if self._stopping:
                        return
                    self._cond.wait()
                # the next call prepared during the last one, and full: a sentence taken now could not join it, so the
                # preparing thread takes them during that call, off this thread (the window graph's overlap)
                full = self._in_flight.next_call_full
                if not self._in_flight.busy:
                    self._wait_for_company()
                elif not self._stopping and not full:
                    self._wait_for_those_answered()
                joining = [] if full else self._take()
            try:
                self._answered = self._window(joining)
            except Exception as err:  # a bug, not an engine failure: fail what is in flight, keep serving
                log.exception("the batcher failed; failing the %d sentences in flight", len(self._in_flight.rows))
                cleared = [row.tag for row in self._in_flight.clear()]
                entries = {id(entry): entry for entry, _ in [*joining, *self._joined_ahead, *cleared]}
                self._joined_ahead = []
                for entry in entries.values():
                    self._loop.call_soon_threadsafe(self._fail, entry, err)
                self._answered = 0

    def _intake(self) -> None:
        """On the preparing thread, while a call runs: drop the sentences whose client has gone, and let in those
        that wait and fit the budget beside the sentences that continue past the running call."""
        self._in_flight.drop(lambda row: row.tag[0].gone)
        with self._cond:
            joining = self._take()
        self._joined_ahead += joining  # before they are admitted: a failure below still reaches them
        self._in_flight.admit([entry.sentences[i] for entry, i in joining], joining)

    def _wait_for_company(self) -> None:
        """An idle engine waits up to `max_wait` after the oldest sentence, while the queue holds less than the
        budget (called with the lock held)."""
        deadline = self._queue.oldest() + self.max_wait_s
        while self._queue and self._queued_tokens < self.batch_tokens and (wait := deadline - time.perf_counter()) > 0:
            self._cond.wait(wait)

    def _wait_for_those_answered(self) -> None:
        """Clients just answered tend to send again at once: wait up to `gather` until as many sentences wait
        as the last window completed requests, so they join the next window instead of leaving its rows empty
        for a whole window (measured with 32 clients on the full-size model: windows held 26 of 32 rows
        without it). Called with the lock held."""
        deadline = time.perf_counter() + self.gather_s
        while len(self._queue) < self._answered and (wait := deadline - time.perf_counter()) > 0:
            self._cond.wait(wait)

    def _take(self) -> list[Item]:
        """Waiting sentences, each client's in order and the clients in turns, as many as fit the token budget
        beside those in flight (at least one when none are) and the engine's rows. Called with the lock held."""
        taken: list[Item] = []
        held = sum(row.length for row in self._in_flight.rows)  # a row's length counts its boundaries, as _tokens
        while self._queue and len(taken) < self._in_flight.room:
            tokens = _tokens(self._queue.first())
            if held + tokens > self.batch_tokens and (taken or self._in_flight.busy):
                break
            entry, i = self._queue.take()
            self._queued_tokens -= tokens
            entry.waiting -= 1
            if not entry.gone:
                taken.append((entry, i))
                held += tokens
        return taken

    def _window(self, joining: list[Item]) -> int:
        """Let `joining` in, run one window, and answer the sentences that finished; returns how many requests
        that completed."""
        rows_in_flight = self._in_flight
        start = time.perf_counter()
        admitted, self._joined_ahead = self._joined_ahead, []  # while the last call ran: in flight already
        _started(admitted + joining, start)
        self.busy = True
        try:
            rows_in_flight.admit([entry.sentences[i] for entry, i in joining], joining)
            ran = bool(rows_in_flight.rows)
            finished = rows_in_flight.step(self._window_length()) if ran else []
        except Exception as err:  # out of memory, say: the rows' state is unknown, run them again whole
            cleared = [row.tag for row in rows_in_flight.clear()]
            # those admit did not reach, and those the preparing thread took but did not admit
            failed = cleared + [item for item in [*self._joined_ahead, *joining] if item not in cleared]
            self._joined_ahead = []
            log.warning(
                "a window of %d sentences failed (%s): running them again in halves", len(failed), type(err).__name__
            )
            self._run_batch(sorted(failed, key=_tokens, reverse=True))
            return 0
        finally:
            self.busy = False
        if not ran:
            return 0
        sentences, real, computed = rows_in_flight.last_call
        self._on_batch(
            BatchStats(
                sentences=sentences,
                padded_tokens=computed,
                real_tokens=real,
                seconds=time.perf_counter() - start,
                queue_seconds=[start - entry.enqueued for entry, _ in admitted + joining],
            )
        )
        if not finished:
            return 0
        # each sentence's layers are put together where they are used (`result()`), not on this thread
        completed = 0
        for entry, _ in (row.tag for row in finished):
            entry.unfinished -= 1
            completed += entry.unfinished == 0
        self._loop.call_soon_threadsafe(self._deliver, [(*row.tag, row) for row in finished])  # (clears the tags)
        return completed

    def _window_length(self) -> int:
        """Positions for the next call: the window of those in flight, ending early where a sentence in flight ends at
        least half a window away, so that its slot is refilled at the next call instead of idling to the end
        of this one (measured with 32 clients: 30 of 32 rows busy on average instead of 26, +1-5% tokens/s).
        A lone sentence with no one waiting runs to its end in one call: windows only pay off in company (each
        call reads the input weights once), and a newcomer waits at most for that sentence."""
        rows, window = self._in_flight.rows, self._in_flight.window
        if self._in_flight.engine.window:  # the window graph computes its whole window whatever a call asks for
            return window
        if len(rows) == 1 and not self._queue:
            return rows[0].length - rows[0].position
        ends = [left for row in rows if window // 2 <= (left := row.length - row.position) < window]
        return min(ends, default=window)

    def _run_batch(self, batch: list[Item]) -> None:
        """Run whole sentences and answer them; if the engine fails, run the halves, and theirs, down to single
        sentences: only a sentence that fails alone fails its request."""
        batch = [item for item in batch if not item[0].gone]
        if not batch:
            return
        sentences = [entry.sentences[i] for entry, i in batch]
        start = time.perf_counter()
        _started(batch, start)
        self.busy = True
        try:
            layers = self._run(sentences)
        except Exception as err:
            if len(batch) == 1:
                log.warning("engine failed on a single sentence (%s): failing its request", type(err).__name__)
                self._loop.call_soon_threadsafe(self._fail, batch[0][0], err)
                return
            log.warning("engine failed on %d sentences (%s): running them in halves", len(batch), type(err).__name__)
            self._run_batch(batch[: len(batch) // 2])
            self._run_batch(batch[len(batch) // 2 :])
            return
        finally:
            self.busy = False
        self._on_batch(
            BatchStats(
                sentences=len(batch),
                padded_tokens=len(batch) * (max(map(len, sentences)) + 2),
                real_tokens=sum(len(s) + 2 for s in sentences),
                seconds=time.perf_counter() - start,
                queue_seconds=[],
            )
        )
        computed = [(e, i, Computed(a)) for (e, i), a in zip(batch, layers, strict=True)]
        self._loop.call_soon_threadsafe(self._deliver, computed)

    # ---- back on the event loop ---------------------------------------------------------------------------

    @staticmethod
    def _deliver(results: list[tuple[_Entry, int, Layers]]) -> None:
        for entry, i, array in results:
            if hasattr(array, "tag"):
                # a sentence in flight routed by its tag: the request's result holds the sentence and the sentence
                # held the request, a cycle only the garbage collector frees, so the views of a call's pooled output
                # block outlived the answer and the pool made fresh blocks (first-touch writes: slow copies)
                array.tag = None
            if entry.future.done():
                continue
            entry.results[i] = array
            entry.pending -= 1
            if entry.pending == 0:
                if entry.timings is not None:
                    entry.timings.answered = time.perf_counter()
                entry.future.set_result(entry.results)

    @staticmethod
    def _fail(entry: _Entry, err: Exception) -> None:
        if not entry.future.done():
            entry.future.set_exception(err)


def _started(items: list[Item], now: float) -> None:
    """The requests whose first sentence starts now, for those that keep timings."""
    for entry, _ in items:
        if entry.timings is not None and entry.timings.started is None:
            entry.timings.started = now


class _Queue(Turns[Item]):
    """The queue: a line of sentences per client, taken from in turns (round robin by sentence: service/turns.py),
    each client's waiting tokens in `held`."""

    def __init__(self) -> None:
        super().__init__(weight=_tokens)

    def newest_whole(self, client: str, skip: int = 0) -> _Entry | None:
        """The newest request of `client` none of whose sentences has left the queue, after its `skip` newest
        ones; None if there is none (its older ones are being taken)."""
        seen: _Entry | None = None
        for entry, _ in reversed(self.line(client)):
            if entry is seen:
                continue
            seen = entry
            if entry.waiting != len(entry.sentences) or entry.gone:
                return None
            if skip == 0:
                return entry
            skip -= 1
        return None

    def oldest(self) -> float:
        """When the sentence that has waited longest was queued."""
        return min(entry.enqueued for entry, _ in self.heads())

    def drop(self, entry: _Entry) -> int:
        """Drop every waiting sentence of `entry`; the tokens they held."""
        return sum(map(_tokens, self.remove(entry.client, lambda item: item[0] is entry)))
