"""The engine's thread: it applies the queue's policy (service/batching/queue.py) to the sentences in flight
(service/batching/in_flight.py), runs the engine's calls through them, retries what a failed window held, and hands
the answers back to the event loop. The only thread that runs the engine's calls (on the window graph a preparing
thread builds the next call's feeds beside it); it calls the sentences in flight, which call the engine through its
backend (service/engine/backend.py), never the other way.

* Continuous batching: every call advances each sentence in flight by a window of positions, and between calls
  finished sentences are answered and waiting ones join, in queue order, as long as the tokens in flight stay
  within the token budget (at least one sentence always runs, however long). An idle engine first waits up to
  `max_wait` for company; after a window that answered clients, the next one waits up to `gather` for them to send
  again; a window ends early where a sentence ends (see `_window_length`). A request larger than the budget is
  simply spread over time.
* Sentences whose client has gone are dropped before they cost compute: from flight before the next window (and
  from the queue as they come up).
* A window the engine fails on (out of memory, say) takes its sentences out of flight; they are run again
  whole, in halves, down to single sentences, so only a request whose own sentence fails alone gets the
  error, everyone else is answered, and the server keeps serving.
* On the window graph (a GPU's), the host's side of a call overlaps the call before it: while this thread waits
  for call N, another thread takes the sentences that fit the budget from the queue (`_intake`: the turns and
  budget as above, the sentences N finishes no longer counted) and builds call N+1's feeds (char ids, packing, token
  cache). A sentence queued after that, which call N+1 has room for, makes this thread build N+1 again before it
  runs, so a newcomer never waits an extra call; under load the call is full and nothing is rebuilt.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from service.batching.in_flight import InFlight, PackedInFlight
from service.batching.queue import Entry, Item, Queue, tokens

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


@dataclass
class BatchStats:
    """What one engine call was, for the metrics: a window over the sentences in flight (or a retry)."""

    sentences: int
    padded_tokens: int  # positions computed, padding included (the Loop graph's: rows x the longest window)
    real_tokens: int  # the sentences' own positions, boundary tokens included
    seconds: float
    queue_seconds: list[float]  # of the sentences that joined with it


class EngineThread:
    """The thread that runs the engine for one batcher. `queue` and `stopping` are shared with the event loop, under
    `lock` (the batcher's); everything else is this thread's (and, during a call, the preparing thread's)."""

    def __init__(
        self,
        run: EngineRun,
        in_flight: InFlight | PackedInFlight,
        queue: Queue,
        lock: threading.Condition,
        batch_tokens: int,
        max_wait_s: float,
        gather_s: float,
        on_batch: Callable[[BatchStats], None],
    ):
        self._run = run  # whole sentences (boundaries included), for the retries after a failed window
        self._in_flight = in_flight
        self._queue = queue
        self._cond = lock
        self.batch_tokens = batch_tokens
        self.max_wait_s = max_wait_s
        self.gather_s = gather_s
        self._on_batch = on_batch
        self.stopping = False  # set under the lock: finish what is queued and in flight, then return
        self.busy = False  # an engine call is running
        self._answered = 0  # requests the last window completed
        self._joined_ahead: list[Item] = []  # taken while the last call ran (`_intake`), counted with the next one
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start the thread; answers are handed to `loop`."""
        self._loop = loop
        self._thread = threading.Thread(target=self._work, name="engine", daemon=True)
        self._thread.start()

    def join(self) -> None:
        if self._thread:
            self._thread.join()

    def _work(self) -> None:
        while True:
            self._in_flight.drop(lambda row: row.tag[0].gone)  # before taking: they free budget
            with self._cond:
                while not self._queue and not self._in_flight.busy:
                    if self.stopping:
                        return
                    self._cond.wait()
                # the next call prepared during the last one, and full: a sentence taken now could not join it, so the
                # preparing thread takes them during that call, off this thread (the window graph's overlap)
                full = self._in_flight.next_call_full
                if not self._in_flight.busy:
                    self._wait_for_company()
                elif not self.stopping and not full:
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
                    self._loop.call_soon_threadsafe(_fail, entry, err)
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
        while self._queue and self._queue.tokens < self.batch_tokens and (wait := deadline - time.perf_counter()) > 0:
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
        """The queue's next sentences for those in flight (queue.Queue.take). Called with the lock held."""
        rows = self._in_flight
        held = sum(row.length for row in rows.rows)  # a row's length counts its boundaries, as queue.tokens
        return self._queue.take(self.batch_tokens, held, rows.room, rows.busy)

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
            finished = rows_in_flight.step(self._window_length(), self._intake) if ran else []
        except Exception as err:  # out of memory, say: the rows' state is unknown, run them again whole
            cleared = [row.tag for row in rows_in_flight.clear()]
            # those admit did not reach, and those the preparing thread took but did not admit
            failed = cleared + [item for item in [*self._joined_ahead, *joining] if item not in cleared]
            self._joined_ahead = []
            log.warning(
                "a window of %d sentences failed (%s): running them again in halves", len(failed), type(err).__name__
            )
            self._run_batch(sorted(failed, key=tokens, reverse=True))
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
        self._loop.call_soon_threadsafe(_deliver, [(*row.tag, row) for row in finished])  # (clears the tags)
        return completed

    def _window_length(self) -> int:
        """Positions for the next call: the window of those in flight, ending early where a sentence in flight ends at
        least half a window away, so that its slot is refilled at the next call instead of idling to the end
        of this one (measured with 32 clients: 30 of 32 rows busy on average instead of 26, +1-5% tokens/s).
        A lone sentence with no one waiting runs to its end in one call: windows only pay off in company (each
        call reads the input weights once), and a newcomer waits at most for that sentence."""
        rows, window = self._in_flight.rows, self._in_flight.window
        if self._in_flight.whole_window:  # the window graph computes its whole window whatever a call asks for
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
                self._loop.call_soon_threadsafe(_fail, batch[0][0], err)
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
        self._loop.call_soon_threadsafe(_deliver, computed)


def _started(items: list[Item], now: float) -> None:
    """The requests whose first sentence starts now, for those that keep timings."""
    for entry, _ in items:
        if entry.timings is not None and entry.timings.started is None:
            entry.timings.started = now


# ---- back on the event loop -----------------------------------------------------------------------------------


def _deliver(results: list[tuple[Entry, int, Layers]]) -> None:
    for entry, i, array in results:
        if not isinstance(array, Computed):
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


def _fail(entry: Entry, err: Exception) -> None:
    if not entry.future.done():
        entry.future.set_exception(err)
