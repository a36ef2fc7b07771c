"""What a graph call is fed and what it gives back, in numpy: the positions of each row as unique tokens + indices
into them (`token_inputs`, `index_rows`; the Loop graph's `encode_windows`), the shapes the window graph is fed in
(`bucket`), and the Loop graph's outputs written back into each sentence's layers (`place`)."""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Sequence

import numpy as np

from service.engine.token_cache import TokenCache
from service.text.token_ids import Mapping


def sentence_keys(sentence: Sequence[str], mapping: Mapping) -> list[Hashable]:
    """The sentence as the biLM reads it: the begin boundary, each token's key (text/token_ids.py), the end one."""
    begin, end = mapping.boundaries
    key = mapping.key
    return [begin, *[key(token) for token in sentence], end]


Window = tuple[Sequence[Hashable], int, int]  # a sentence's keys (`sentence_keys`), first position, positions


def token_inputs(
    rows: Sequence[Sequence[Hashable]],
    mapping: Mapping,
    dim: int,
    cache: TokenCache | None = None,
    bucketed: bool = False,
) -> tuple[dict[str, np.ndarray], dict[Hashable, int], dict[Hashable, int]]:
    """The graph's token inputs for every key the rows read: each distinct key once (tokens that differ only past
    the kept bytes share one), encoded from its chars (`token_chars`) or taken from the cache (`cached_vectors`);
    at least one row is encoded. `bucketed` pads both to a `bucket` size (rows of id 0 and zero vectors, never
    read). Returns the feeds, each key's index into [encoded; cached], and what is encoded (key -> row of
    `token_vectors`)."""
    encode: dict[Hashable, int] = {}
    cached: dict[Hashable, int] = {}
    cached_vectors: list[np.ndarray] = []
    distinct = list(dict.fromkeys(itertools.chain.from_iterable(rows)))  # each distinct key once, in order
    found = cache.get_many(distinct) if cache is not None else [None] * len(distinct)
    for key, vector in zip(distinct, found, strict=True):
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
    index_of = encode | {key: offset + row for key, row in cached.items()}
    feeds = {
        "token_chars": chars,
        "cached_vectors": np.stack(cached_vectors) if cached_vectors else np.zeros((0, dim), np.float32),
    }
    return feeds, index_of, encode


def index_rows(rows: Sequence[Sequence[Hashable]], index_of: dict[Hashable, int], shape: tuple[int, int]) -> np.ndarray:
    """Each row's keys as indices into the token vectors, (rows, steps); padding points at row 0: never read."""
    index = np.zeros(shape, dtype=np.int64)
    for row, keys in enumerate(rows):
        index[row, : len(keys)] = [index_of[k] for k in keys]
    return index


def encode_windows(
    windows: Sequence[Window], mapping: Mapping, dim: int, cache: TokenCache | None = None
) -> tuple[dict[str, np.ndarray], dict[Hashable, int]]:
    """The Loop graph's token inputs for a window of positions of each sentence (the backward direction reads
    positions first..first+n-1 of the sentence reversed), and what it will encode (key -> row of
    `token_vectors`)."""
    forward = [keys[first : first + n] for keys, first, n in windows]
    backward = [keys[len(keys) - first - n : len(keys) - first][::-1] for keys, first, n in windows]
    feeds, index_of, encode = token_inputs(forward + backward, mapping, dim, cache)
    shape = (len(windows), max(n for _, _, n in windows))
    feeds["lengths"] = np.array([n for _, _, n in windows], np.int64)
    feeds["index_fwd"] = index_rows(forward, index_of, shape)
    feeds["index_bwd"] = index_rows(backward, index_of, shape)
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
