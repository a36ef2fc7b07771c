"""What the rest of the service calls an engine through: two typed interfaces, one per graph, which
service/engine/session.py's `Engine` gives (a test's wrapper may stand in for it). Calls go one way: the sentences in
flight (service/batching/in_flight.py, service/engine/packing.py) and the batcher's engine thread call a backend; a
backend never calls them, nor knows whose sentences it computes.

- `LoopBackend`, the Loop graph (the CPU's): a window of positions of each row from the state its slot holds (`step`).
- `WindowBackend`, the window graph (a GPU's): a call on rows packed with sentences, its feeds built first
  (`prepare_packed`, on another thread while the call before runs) and then run (`run_prepared`), which returns the
  call's outputs for the caller to keep.

Both run whole sentences (`run`: the batcher's retries after a failed window, elmo-embed). The modules that drive a
backend import this one, never the session (an import contract): the session is free to import them (Engine.run packs
a finite batch with packing.PackedRows)."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from service.engine.feeds import Window
from service.manifest import ModelInfo
from service.text.token_ids import Mapping


class Keyed(Protocol):
    """A sentence as a backend reads it: its keys (boundaries included; service/engine/feeds.py: sentence_keys)."""

    @property
    def keys(self) -> list[Hashable]: ...

    @property
    def length(self) -> int: ...


Segment = tuple[Keyed, int, int]  # a sentence, its first position in this call, positions in this call


@dataclass
class Computed:
    """What one window call computed (`WindowBackend.run_prepared`): the rows it ran (those given, padded to the
    shapes the graph is fed in), the token layer (N, P) and the LSTM layers (L, 2, N, P) at its positions, N the
    segments' positions one after the other in the order of the call's rows (views of a reused host block: the
    sentences keep them until they are answered)."""

    padded_rows: int
    token_layer: np.ndarray
    lstm: np.ndarray


class Backend(Protocol):
    """What both graphs give: the model, the rows a call may hold, and whole sentences."""

    info: ModelInfo
    max_rows: int

    @property
    def mapping(self) -> Mapping: ...

    def run(self, sentences: Sequence[Sequence[str]], boundaries: bool = False) -> list[np.ndarray]:
        """Each sentence's layers, (num_layers, n_tokens, dim) float32 (`boundaries`: n_tokens + 2 positions)."""
        ...


class LoopBackend(Backend, Protocol):
    """The Loop graph: any number of positions a call; each row's LSTM state kept in a slot between calls."""

    def step(self, windows: Sequence[Window], start: np.ndarray, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Run each window from the initial state where `start`, else from its slot's state; the forward and
        backward layers (L+1, N, P) at the windows' positions."""
        ...


class WindowBackend(Backend, Protocol):
    """The window graph: `window` positions of every row a call, rows packed with sentences; the state a call
    leaves stays with the backend, for the next call's rows to continue from (`source`)."""

    window: int

    def call_packed(self, rows: list[list[Segment]], source: list[int]) -> Computed:
        """One call on packed rows, its feeds built and run in series (`prepare_packed`, then `run_prepared`)."""
        ...

    def prepare_packed(self, rows: list[list[Segment]], source: list[int]) -> object:
        """A call's feeds, built from the sentences' keys (thread-safe beside a running call)."""
        ...

    def run_prepared(self, prepared: object) -> Computed:
        """Run a prepared call (in the order they were prepared: each continues from the state the one before
        left)."""
        ...
