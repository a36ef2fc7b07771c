"""The engine's cache of token vectors: the char-CNN's output for tokens seen recently."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable

import numpy as np


class TokenCache:
    """Token vectors (the char-CNN's output) of recently seen tokens, at most `size`, least recent out first.

    A token's vector depends on its row alone (the cache's key is the mapping's `key`: at most 48 bytes or
    characters however long the token; service/text/token_ids.py), and the graph computes it with the same bits in any
    batch, so a cached vector equals a recomputed one exactly: the cache saves the char-CNN's share of the work
    (about a quarter of the model) for frequent words and changes no output."""

    def __init__(self, size: int):
        self.size = size
        self._vectors: OrderedDict[Hashable, np.ndarray] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._vectors)

    def get(self, key: Hashable) -> np.ndarray | None:
        with self._lock:
            vector = self._vectors.get(key)
            if vector is not None:
                self._vectors.move_to_end(key)
            return vector

    def get_many(self, keys) -> list[np.ndarray | None]:
        """`get` of each key, under one acquisition of the lock."""
        with self._lock:
            found = [self._vectors.get(key) for key in keys]
            for key, vector in zip(keys, found, strict=True):
                if vector is not None:
                    self._vectors.move_to_end(key)
        return found

    def put(self, key: Hashable, vector: np.ndarray) -> None:
        if self.size <= 0:
            return
        with self._lock:
            self._vectors[key] = vector
            self._vectors.move_to_end(key)
            while len(self._vectors) > self.size:
                self._vectors.popitem(last=False)
