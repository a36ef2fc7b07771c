"""Continuous batching: the sentences in flight advance a window of positions at a time, and new ones join
between windows.

A whole batch runs as many time steps as its longest sentence, and a step costs nearly as much for one row as
for thirty (each reads all of a layer's recurrent weights: 80 MB per layer on the full-size model), so with
sentences of mixed lengths the tail of a batch runs nearly empty; and a request that arrives during a batch
waits for all of it. Here each call runs the next `window` positions of every sentence in flight, each from
the state its last window left it in; sentences that finish leave and waiting ones join at once, so the steps
stay full while clients come and go (iteration-level scheduling, as LLM servers do it, with a window of
several steps so that each layer's input products stay one large product per window, and the per-call
overhead small).

On the Loop graph (the CPU's) each sentence in flight holds a slot of the engine's state store, where its LSTM
state stays between windows (`InFlight`). On the window graph (a GPU's), whose every call computes its whole window
of every row, rows are packed with sentences one after the other (`PackedInFlight`, service/engine/packing.py), so
that no row idles to the end of a window. Either way it is the same graph as a whole run (model_export/onnx_graph.py),
so a sentence's vectors are the same bits window by window as whole, whatever else is in flight (on the CPU:
tests/service/batching/test_in_flight.py; a GPU's kernels may round a product differently for another number of
rows).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from service.engine.backend import LoopBackend, WindowBackend
from service.engine.feeds import place, sentence_keys
from service.engine.packing import Beside, PackedRows, Sentence
from service.engine.session import Engine

Intake = Callable[[], object]  # the scheduler's: lets the sentences that wait join, beside a running call


class Row:
    """One sentence in flight: `layers` (L+1, T, 2P) fills in window by window; T counts <S> and </S>."""

    __slots__ = ("keys", "layers", "position", "slot", "tag")

    def __init__(self, tag: object, keys: list, num_layers: int, dim: int, slot: int):
        self.tag = tag  # the caller's, to route the result
        self.keys = keys
        self.layers = np.empty((num_layers, len(keys), dim), np.float32)
        self.position = 0  # positions done
        self.slot = slot  # where the engine keeps its state after `position`

    @property
    def length(self) -> int:
        return len(self.keys)

    def result(self, boundaries: bool = False) -> np.ndarray:
        """(L+1, n_tokens, 2P), boundary positions cut off, as `Engine.run` returns it (`boundaries`: kept)."""
        return self.layers if boundaries else np.ascontiguousarray(self.layers[:, 1:-1])


def in_flight(engine: Engine, window: int) -> InFlight | PackedInFlight:
    """The sentences in flight on `engine`: window by window on the Loop graph, packed rows on the window graph."""
    return PackedInFlight(engine) if engine.window else InFlight(engine, window)


class InFlight:
    """The sentences in flight on a Loop-graph engine, at most `engine.max_rows`, each advancing `window`
    positions a call (the Loop graph computes only real positions: nothing to pack). Not thread-safe: one thread
    drives it."""

    def __init__(self, engine: LoopBackend, window: int):
        self.engine, self.window = engine, window
        self.rows: list[Row] = []
        self._free = list(range(engine.max_rows, 0, -1))  # slots 1..max_rows; slot 0 is the engine's scratch
        self.last_call = (0, 0, 0)  # the last call's sentences, their positions, and the positions computed

    @property
    def room(self) -> int:
        """How many more sentences may join."""
        return len(self._free)

    @property
    def busy(self) -> bool:
        """Whether any sentence is in flight."""
        return bool(self.rows)

    next_call_full = False  # the Loop graph prepares no call ahead
    whole_window = False  # a call computes the positions it is asked for

    def overlap(self, on: bool) -> None:
        """Nothing to overlap: the Loop graph prepares no call ahead (its host work is each call's own)."""

    def admit(self, sentences: Sequence[Sequence[str]], tags: Sequence[object]) -> None:
        """Let sentences join (at most `room`): they start with the next `step`."""
        info = self.engine.info
        if len(sentences) > self.room:
            raise ValueError(f"{len(sentences)} sentences cannot join: room for {self.room}")
        for sentence, tag in zip(sentences, tags, strict=True):
            keys = sentence_keys(sentence, info.mapping)
            self.rows.append(Row(tag, keys, info.num_layers, info.dim, self._free.pop()))

    def step(self, window: int | None = None, intake: Intake | None = None) -> list[Row]:
        """Run the next window (`window` positions, default `self.window`) of every row; returns the rows that
        finished (and are no longer in flight). Nothing is prepared ahead: `intake` is not called (the scheduler
        lets sentences in between calls)."""
        rows, window = self.rows, window or self.window
        windows = [(row.keys, row.position, min(window, row.length - row.position)) for row in rows]
        self.last_call = (len(windows), sum(n for _, _, n in windows), len(windows) * max(n for _, _, n in windows))
        start = np.array([row.position == 0 for row in rows])
        fwd, bwd = self.engine.step(windows, start, np.array([row.slot for row in rows], np.int64))
        place([row.layers for row in rows], windows, fwd, bwd, self.engine.info.token_dim)
        for row, (_, _, n) in zip(rows, windows, strict=True):
            row.position += n
        self.rows = [row for row in rows if row.position < row.length]
        finished = [row for row in rows if row.position == row.length]
        self._free += [row.slot for row in finished]
        return finished

    def drop(self, unwanted: Callable[[Row], bool]) -> list[Row]:
        """Take the rows for which `unwanted(row)` holds out of flight (their client has gone), and return them."""
        gone, kept = [], []
        for row in self.rows:
            (gone if unwanted(row) else kept).append(row)
        self.rows = kept
        self._free += [row.slot for row in gone]
        return gone

    def clear(self) -> list[Row]:
        """Take every row out of flight (after a failed window: their state is unknown), and return them."""
        rows, self.rows = self.rows, []
        self._free += [row.slot for row in rows]
        return rows


class PackedInFlight:
    """The sentences in flight on a window-graph engine: rows packed with sentences (service/engine/packing.py),
    each call the graph's whole window of every row. Sentences join between calls, as many as the next call can
    start (`room`). Not thread-safe: one thread drives it."""

    whole_window = True  # every call computes the graph's whole window, whatever it is asked for

    def __init__(self, engine: WindowBackend):
        self.engine, self.window = engine, engine.window
        self.packed = PackedRows(engine)
        self.last_call = (0, 0, 0)  # the last call's sentences, their positions, and the positions computed

    @property
    def rows(self) -> list[Sentence]:
        """Every sentence in flight, those being computed first."""
        return self.packed.in_flight

    @property
    def room(self) -> int:
        """How many more sentences may join: as many as the next call could start (each is at least 3 positions);
        the batcher's token budget bounds them first. Fewer waiting than a call can take would leave rows empty."""
        return max(0, self.engine.max_rows * self.window // 3 - len(self.packed.waiting))

    @property
    def busy(self) -> bool:
        """Whether any sentence is in flight (without listing them: `rows` does)."""
        return self.packed.busy

    @property
    def next_call_full(self) -> bool:
        """The next call is prepared (`overlap`) with no room for a sentence that joined now."""
        return self.packed.ahead is not None and not self.packed.ahead_open

    def overlap(self, on: bool) -> None:
        """Build each call's feeds while the call before it runs (packing.PackedRows' prefetch), or not: see `step`."""
        self.packed.prefetch = on

    def admit(self, sentences: Sequence[Sequence[str]], tags: Sequence[object]) -> None:
        """Let sentences join (at most `room`): they start with the next calls."""
        if len(sentences) > self.room:
            raise ValueError(f"{len(sentences)} sentences cannot join: room for {self.room}")
        self.packed.admit(sentences, tags)

    def step(self, window: int | None = None, intake: Intake | None = None) -> list[Sentence]:
        """Run the next call (the graph's window, whatever `window` says); the sentences it finished. With `overlap`,
        while it runs another thread calls `intake` (the scheduler admits the sentences that wait then, so that they
        join the next call, not the one after) and then prepares the next call."""
        positions, computed = self.packed.positions, self.packed.computed
        finished = self._step_overlapped(intake) if self.packed.prefetch and intake is not None else self.packed.step()
        self.last_call = (self.packed.segments, self.packed.positions - positions, self.packed.computed - computed)
        return finished

    def _step_overlapped(self, intake: Intake) -> list[Sentence]:
        packed = self.packed
        call = packed.begin()
        if call is None:
            return []

        def prepare() -> None:
            intake()
            packed.prepare_ahead()

        return packed.run_beside(call, Beside(prepare).start())

    def drop(self, unwanted: Callable[[Sentence], bool]) -> list[Sentence]:
        return self.packed.drop(unwanted)

    def clear(self) -> list[Sentence]:
        return self.packed.clear()
