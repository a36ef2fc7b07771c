"""Packed rows: how the window graph computes tokens, not padding.

The window graph runs a fixed window of W positions of every row per call. If a row held one sentence, every row
would run to the end of the window after its sentence ended, and a call would run until the longest row of its
batch ended: on a GPU about a third of the positions computed were padding. Here a row is a stream of sentences,
one after the other: where a sentence ends inside the window, the next waiting one starts at the next position
(the graph resets the state there: `resets`), so every row is full while sentences wait, and only the stream's
end is padding. A sentence that does not end inside the window continues in the same row at the next call, from
the state the call left in that row (`source`); rows with nothing left are dropped from the next call.

A sentence's numbers do not depend on where it runs: each position's products are per row, and each sentence
starts from the model's initial state wherever it starts (tests/service/engine/test_packing.py: the same bits on
the CPU, alone, packed, or in any row).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable, Iterable, Sequence

import numpy as np

from service.engine.backend import Computed, WindowBackend
from service.engine.feeds import sentence_keys

Segment = tuple["Sentence", int, int]  # a sentence, its first position in this call, positions (backend.Segment)

Call = tuple[list[list[Segment]], object]  # a call's rows and its feeds (WindowBackend.prepare_packed), ready to run


class Sentence:
    """One sentence in flight: its keys (boundaries included), and what each call computed of it, kept as views of
    that call's output (no copy on the engine's thread); `result` puts them together where they are consumed."""

    __slots__ = ("done", "keys", "pieces", "tag")

    def __init__(self, tag: object, keys: list[Hashable]):
        self.tag, self.keys = tag, keys  # the caller's tag, to route the result
        # first position, positions, the call's token layer (N, P) and LSTM layers (L, 2, N, P), at
        self.pieces: list[tuple[int, int, np.ndarray, np.ndarray, int]] = []
        self.done = 0  # positions computed

    @property
    def length(self) -> int:
        return len(self.keys)

    @property
    def position(self) -> int:
        """Positions done (as a row of the Loop graph's in-flight set says it)."""
        return self.done

    @property
    def finished(self) -> bool:
        return self.done == len(self.keys)

    def result(self, dtype=np.float32, out: np.ndarray | None = None, boundaries: bool = False) -> np.ndarray:
        """(L+1, n_tokens, 2P), boundary positions cut off, as `Engine.run` returns it (`boundaries`: kept, first
        and last, n_tokens + 2): the forward half at the positions read, the backward half at the positions the
        sentence reversed read; layer 0 (the token vector, the same in both halves) written twice from the one copy
        the graph returns. `dtype` float16 halves the bytes of those who ask for it (the numbers rounded once,
        here). `out`, if given, is written instead of a new array (elmo-embed's shared-memory blocks: the one
        copy)."""
        first_lstm = self.pieces[0][3]
        half, length = first_lstm.shape[-1], len(self.keys)
        cut = 0 if boundaries else 1  # positions dropped at each end: position p is written at p - cut
        if out is None:
            out = np.empty((first_lstm.shape[0] + 1, length - 2 * cut, 2 * half), dtype)
        for first, n, token_layer, lstm, q in self.pieces:  # lstm: (L, 2, N, P) of the call
            # forward: positions first .. first+n-1; backward: the sentence reversed read them, so it computed
            # positions end-n .. end-1 (end = length - first), last first
            lo, hi = max(first, cut), min(first + n, length - cut)
            if lo < hi:
                out[0, lo - cut : hi - cut, :half] = token_layer[q + lo - first : q + hi - first]
                out[1:, lo - cut : hi - cut, :half] = lstm[:, 0, q + lo - first : q + hi - first]
            end = length - first
            lo, hi = max(end - n, cut), min(end, length - cut)
            if lo < hi:
                out[1:, lo - cut : hi - cut, half:] = lstm[:, 1, q : q + n][:, ::-1][:, lo - end + n : hi - end + n]
        out[0, :, half:] = out[0, :, :half]
        return out


def finite_rows(positions: int, window: int, multiple: int, max_rows: int) -> int:
    """The rows to run a finite batch of `positions` positions (boundaries included) on: enough for about
    FINITE_CALLS calls, so that only the last call or two of each row are partly padding, in multiples of
    `multiple` (the rows a call is fed as), at most `max_rows`."""
    rows = -(-positions // (window * FINITE_CALLS))
    return max(multiple, min(max_rows, -(-rows // multiple) * multiple))


# Calls a finite batch's rows are sized for: more calls, less padding at the rows' ends (fewer rows run longer),
# but each call has fewer rows to spread over a GPU.
FINITE_CALLS = 8


class Beside:
    """Work on a thread of its own while a call runs (ONNX Runtime lets go of the interpreter while it runs): the
    next call's feeds built, and whatever its caller does first (the batcher takes the sentences that wait). Started
    by whoever made it; `PackedRows.run_beside` joins it after the call and raises what it raised."""

    def __init__(self, work: Callable[[], object]):
        self.failure: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(work,), name="elmo-prepare")

    def _run(self, work: Callable[[], object]) -> None:
        try:
            work()
        except BaseException as err:  # raised on the engine's thread, after its call
            self.failure = err

    def start(self) -> Beside:
        self._thread.start()
        return self

    def join(self) -> None:
        self._thread.join()


class PackedRows:
    """The sentences in flight on a window engine: those each row is in the middle of, and those waiting to start.
    `step` runs one call and returns the sentences it finished. Not thread-safe: one thread drives it (with
    `prefetch`, the thread of a `Beside` prepares the next call while the driving thread waits for the running one)."""

    def __init__(self, engine: WindowBackend, max_rows: int | None = None, prefetch: bool = False):
        self.engine, self.window = engine, engine.window
        self.max_rows = max_rows or engine.max_rows
        self.prefetch = prefetch  # `step`: the next call's feeds built while this one runs
        self.ahead: Call | None = None  # with prefetch: the next call, prepared
        # what preparing `ahead` moved past, to plan it again when sentences join that it had room for
        self._before: tuple[list[Sentence | None], list[Sentence]] | None = None
        self.ahead_open = False  # `ahead` took every waiting sentence and has free positions or rows
        self.failed: list[list[Segment]] = []  # the rows of a call that raised, until `clear` hands them back
        self.prepare_s = 0.0  # with prefetch: host seconds spent building feeds beside a running call
        self.replanned = 0  # with prefetch: calls prepared ahead, then again in series for sentences that joined
        self.rows: list[Sentence | None] = []  # per row of the last call: the sentence that continues in it
        self.waiting: deque[Sentence] = deque()
        self.positions = 0  # sentences' own positions computed, over every call
        self.computed = 0  # positions computed, padding included
        self.segments = 0  # sentences (or parts of them) the last call computed

    def admit(self, sentences: Iterable[Sequence[str]], tags: Iterable[object]) -> None:
        mapping = self.engine.mapping
        for sentence, tag in zip(sentences, tags, strict=True):
            self.waiting.append(Sentence(tag, sentence_keys(sentence, mapping)))

    @property
    def busy(self) -> bool:
        """Whether any sentence is in flight (a row whose sentence left, `None`, holds none)."""
        return bool(any(s is not None for s in self.rows) or self.waiting or self.ahead or self.failed)

    @property
    def in_flight(self) -> list[Sentence]:
        """Every sentence not finished: those a failed call was to finish, those of a call prepared ahead
        (`prefetch`), those in a row, then those waiting. With prefetch the bookkeeping runs a call ahead, so the
        sentences a call finishes are in neither the rows nor the waiting ones: they are listed by their calls."""
        ahead = self._finished(self.failed) + (self._finished(self.ahead[0]) if self.ahead else [])
        return ahead + [s for s in self.rows if s is not None] + list(self.waiting)

    @property
    def pending_positions(self) -> int:
        """Positions left to compute of every sentence in flight."""
        return sum(s.length - s.done for s in self.in_flight)

    @property
    def efficiency(self) -> float:
        """Padding efficiency so far: the sentences' positions over the positions computed."""
        return self.positions / self.computed if self.computed else 1.0

    def drop(self, unwanted: Callable[[Sentence], bool]) -> list[Sentence]:
        """Take the sentences for which `unwanted` holds out of flight (their client has gone); a row whose
        sentence leaves is refilled or dropped at the next call."""
        gone = [s for s in self.in_flight if unwanted(s)]
        if self.ahead is not None and any(unwanted(s) for row in self.ahead[0] for s, _, _ in row):
            # one is in the call prepared ahead (no call runs now): it is planned again without it, before it costs
            # compute
            self._unprepare()
            self.replanned += 1
        self.rows = [None if s is not None and unwanted(s) else s for s in self.rows]
        self.waiting = deque(s for s in self.waiting if not unwanted(s))
        return gone

    def clear(self) -> list[Sentence]:
        """Take every sentence out of flight (after a failed call: their state is unknown), and return them."""
        every = self.in_flight
        self.rows, self.waiting, self.ahead, self.failed, self._before = [], deque(), None, [], None
        return every

    def plan(self) -> tuple[list[list[Segment]], list[int]]:
        """The next call's rows (each a list of segments filling up to W positions) and, for each, the row of the
        last call it continues from (0 where it starts afresh). Rows that continue come first, in their order, each
        filled up from the waiting sentences; then new rows, while sentences wait and rows are free. Changes
        nothing: `step` runs the plan."""
        return self._plan()[:2]

    def _plan(self) -> tuple[list[list[Segment]], list[int], int]:
        waiting, taken = iter(self.waiting), 0  # taken in order: `step` pops them once the call has run

        def fill(segments: list[Segment], free: int) -> None:
            nonlocal taken
            while free and (sentence := next(waiting, None)) is not None:
                n = min(free, sentence.length)
                segments.append((sentence, 0, n))
                free -= n
                taken += 1

        rows, source = [], []
        for r, current in enumerate(self.rows):
            segments, free = [], self.window
            if current is not None:
                n = min(free, current.length - current.done)
                segments.append((current, current.done, n))
                free -= n
            fill(segments, free)
            if segments:
                rows.append(segments)
                source.append(r if current is not None else 0)
        while taken < len(self.waiting) and len(rows) < self.max_rows:
            segments = []
            fill(segments, self.window)
            rows.append(segments)
            source.append(0)
        return rows, source, taken

    def step(self) -> list[Sentence]:
        """Run the next call; the sentences it finished (no longer in flight). With `prefetch`, the call after it
        is planned and its feeds built on another thread while this one runs (ONNX Runtime lets go of the
        interpreter while it runs): sentences admitted after a step join the call after the next."""
        if self.prefetch:
            return self._step_ahead()
        rows, source, taken = self._plan()
        if not rows:
            self.rows = []
            return []
        computed = self.engine.call_packed(rows, source)
        self._keep(rows, computed)
        self._advance(rows, taken)
        self._count(rows, computed.padded_rows)
        return self._finished(rows)

    @staticmethod
    def _keep(rows: list[list[Segment]], computed: Computed) -> None:
        """Each segment's positions of a call's output, kept in its sentence as views (no copy on this thread)."""
        q = 0
        for segments in rows:
            for sentence, first, n in segments:
                sentence.pieces.append((first, n, computed.token_layer, computed.lstm, q))
                q += n

    def _advance(self, rows: list[list[Segment]], taken: int) -> None:
        """The bookkeeping past a call of `rows`: its sentences started, their positions done, what continues."""
        for _ in range(taken):  # started now: in a row from here on
            self.waiting.popleft()
        for row in rows:
            for sentence, first, n in row:
                sentence.done = first + n
        self.rows = [None if row[-1][0].finished else row[-1][0] for row in rows]
        if not any(self.rows):  # nothing continues: the next call starts afresh
            self.rows = []

    def _count(self, rows: list[list[Segment]], padded_rows: int) -> None:
        self.segments = sum(map(len, rows))
        self.positions += sum(n for row in rows for _, _, n in row)
        self.computed += padded_rows * self.window

    @staticmethod
    def _finished(rows: list[list[Segment]]) -> list[Sentence]:
        """The sentences a call of `rows` finishes (by its segments, not by `done`: with prefetch the next call's
        bookkeeping has moved on already)."""
        return [sentence for row in rows for sentence, first, n in row if first + n == sentence.length]

    def _prepare_next(self, overlapped: bool = False) -> None:
        """Plan the next call, build its feeds and move the bookkeeping past it (`self.ahead`). The feeds come
        first: if building them raises, nothing has moved and no sentence is lost."""
        start = time.perf_counter()
        rows, source, taken = self._plan()
        if rows:
            prepared = self.engine.prepare_packed(rows, source)
            self.ahead_open = taken == len(self.waiting) and (
                len(rows) < self.max_rows or any(sum(n for _, _, n in row) < self.window for row in rows)
            )
            self._before = (list(self.rows), list(itertools.islice(self.waiting, taken)))
            self._advance(rows, taken)
            self.ahead = (rows, prepared)
        else:
            self.rows, self.ahead, self._before = [], None, None
        if overlapped:
            self.prepare_s += time.perf_counter() - start

    def _unprepare(self) -> None:
        """Undo `_prepare_next` (its call has not run): the sentences it took wait again, first, and the rows and
        positions are those before it."""
        rows, _ = self.ahead
        before_rows, taken = self._before
        for row in rows:
            for sentence, first, _ in row:
                sentence.done = first
        self.waiting.extendleft(reversed(taken))
        self.rows, self.ahead, self._before = before_rows, None, None

    def _step_ahead(self) -> list[Sentence]:
        call = self.begin()
        if call is None:
            return []
        beside = Beside(self.prepare_ahead).start() if self.rows or self.waiting else None
        return self.run_beside(call, beside)

    def begin(self) -> Call | None:
        """With prefetch: the next call, prepared (None: nothing to run). Sentences that joined since it was prepared,
        which it had room for, are planned into it again, in series (a newcomer is not held back a call; under load
        the call was full and the newcomers wait anyway); the first call (or the first after the rows ran dry) is
        prepared here."""
        if self.ahead is not None and self.ahead_open and self.waiting:
            self._unprepare()
            self.replanned += 1
        if self.ahead is None:
            self._prepare_next()
        call, self.ahead, self._before = self.ahead, None, None
        return call

    def prepare_ahead(self) -> None:
        """With prefetch, on a `Beside`'s thread while the call `begin` gave runs: the call after it, prepared."""
        self._prepare_next(overlapped=True)

    def run_beside(self, call: Call, beside: Beside | None) -> list[Sentence]:
        """Run `call` (from `begin`) while `beside` (started) prepares the next one; the sentences the call finished.
        If either raises, the call's sentences are handed back by `clear` (with those prepared after it and those
        waiting), none lost and none answered: the caller runs them again or fails them."""
        rows, prepared = call
        try:
            computed = self.engine.run_prepared(prepared)
        except BaseException as err:
            self.failed = rows
            if hasattr(err, "add_note"):  # Python 3.11 on
                err.add_note(f"a window call of {sum(map(len, rows))} sentence segments failed; its sentences and "
                             "those after it are handed back by clear()")  # fmt: skip
            raise
        finally:
            if beside is not None:
                beside.join()
        self._keep(rows, computed)
        if beside is not None and beside.failure is not None:
            self.failed = rows  # ran, but its sentences are not handed out: the caller clears and runs them again
            raise beside.failure
        self._count(rows, computed.padded_rows)
        return self._finished(rows)
