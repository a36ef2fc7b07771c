"""What a graph call is fed and what it gives back, in numpy: a window of positions of each sentence as unique
tokens + indices into them (`encode_windows`), the shapes the window graph is fed in (`bucket`), and its packed
outputs written back into each sentence's layers (`place`)."""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Sequence

import numpy as np

from service.engine.token_cache import TokenCache
from service.text.token_ids import Mapping


def sentence_keys(sentence: Sequence[str], mapping: Mapping) -> list[Hashable]:
    """The sentence as the biLM reads it: the begin boundary, each token's key (text/token_ids.py), the end one."""
    begin, end = mapping.boundaries
    return [begin, *(mapping.key(token) for token in sentence), end]


Window = tuple[Sequence[Hashable], int, int]  # a sentence's keys (`sentence_keys`), first position, positions


def encode_windows(
    windows: Sequence[Window],
    mapping: Mapping,
    dim: int,
    cache: TokenCache | None = None,
    shape: tuple[int, int] | None = None,
    bucketed: bool = False,
) -> tuple[dict[str, np.ndarray], dict[Hashable, int]]:
    """The graph's token inputs for a window of positions of each sentence, and what it will encode
    (`char_key` -> row of `token_vectors`).

    The backward direction reads positions first..first+n-1 of the sentence reversed. Each distinct key
    appears once (tokens that differ only past the kept bytes share one): encoded from its chars
    (`token_chars`), or taken from the cache (`cached_vectors`); at least one row is encoded. `shape`
    (rows, steps) pads the index inputs to that shape (the window graph's bucket), and `bucketed` pads the
    encoded and the cached tokens to a `bucket` size (rows of id 0 and zero vectors, never read)."""
    forward = [keys[first : first + n] for keys, first, n in windows]
    backward = [keys[len(keys) - first - n : len(keys) - first][::-1] for keys, first, n in windows]
    encode: dict[Hashable, int] = {}
    cached: dict[Hashable, int] = {}
    cached_vectors: list[np.ndarray] = []
    for key in itertools.chain(*forward, *backward):
        if key in encode or key in cached:
            continue
        vector = cache.get(key) if cache is not None else None
        if vector is None:
            encode[key] = len(encode)
        else:
            cached[key] = len(cached_vectors)
            cached_vectors.append(vector)
    if not encode:  # the graph's char-CNN needs a row
        encode[mapping.boundaries[0]] = 0
    chars = np.stack([mapping.row(key) for key in encode])
    if bucketed:
        chars = np.concatenate([chars, np.zeros((bucket(len(chars)) - len(chars), mapping.width), np.int32)])
        cached_vectors += [np.zeros(dim, np.float32)] * (bucket(len(cached_vectors)) - len(cached_vectors))
    offset = len(chars)  # the indices count the encoded rows first, then the cached ones

    rows, steps = shape or (len(windows), max(n for _, _, n in windows))
    lengths = np.zeros(rows, np.int64)
    lengths[: len(windows)] = [n for _, _, n in windows]
    feeds = {
        "token_chars": chars,
        "cached_vectors": np.stack(cached_vectors) if cached_vectors else np.zeros((0, dim), np.float32),
        "lengths": lengths,
    }
    for name, rows_keys in (("index_fwd", forward), ("index_bwd", backward)):
        index = np.zeros((rows, steps), dtype=np.int64)  # padding points at row 0: never read
        for row, keys in enumerate(rows_keys):
            index[row, : len(keys)] = [encode[k] if k in encode else offset + cached[k] for k in keys]
        feeds[name] = index
    return feeds, encode


def bucket(n: int, floor: int = 16, cap: int | None = None) -> int:
    """The next power of two >= n, at least `floor` (and at most `cap`): the window graph is fed a few shapes,
    so that each can be captured as a CUDA graph and ONNX Runtime plans each once."""
    size = max(floor, 1 << max(0, n - 1).bit_length())
    return min(size, cap) if cap is not None else size


def place(layers: list[np.ndarray], windows: Sequence[Window], fwd: np.ndarray, bwd: np.ndarray, half: int) -> None:
    """Write a step's packed outputs into each row's layers (L+1, T, 2P) (T counts <S> and </S>): the forward
    half at the window's positions, the backward half at the positions it read, the sentence reversed."""
    q = 0
    for row, (keys, first, n) in zip(layers, windows, strict=True):
        row[:, first : first + n, :half] = fwd[:, q : q + n]
        end = len(keys) - first
        row[:, end - n : end, half:] = bwd[:, q : q + n][:, ::-1]
        q += n
