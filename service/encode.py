"""Answers as JSON: their size known before the engine runs, and large ones composed and encoded off the event
loop, in pieces, so that one large answer does not hold up every small request behind it."""

from __future__ import annotations

import asyncio
import base64
import math
from collections import deque
from collections.abc import Callable, Iterator

import numpy as np
import orjson
from fastapi.responses import Response, StreamingResponse

# The most bytes one number of an answer takes: orjson writes a float32 in at most 16 characters
# ("-0.0000037214047") and a comma (11 to 14 on average); base64 writes its 4 bytes as 16/3 characters.
BYTES_PER_NUMBER = {"float": 17, "base64": 16 / 3}
OFF_LOOP_BYTES = 1 << 20  # answers estimated larger are composed and encoded in a worker thread
# Numbers per orjson call off the loop. orjson holds the GIL for a whole call (0.8 s for 16 M numbers), which
# stops the event loop as surely as running on it would; 65 536 of them take it about 4 ms.
PIECE_NUMBERS = 1 << 16
SEND_BYTES = 1 << 20  # a large answer goes out in parts of about this size


class Base64:
    """An array to be written as one base64 string of its little-endian float32 bytes, in C order."""

    __slots__ = ("array",)

    def __init__(self, array: np.ndarray):
        self.array = np.ascontiguousarray(array, dtype="<f4")

    def text(self) -> str:
        return base64.b64encode(self.array.tobytes()).decode("ascii")


def answer_bytes(token_counts: list[int], dim: int, outputs: int, pooled: bool, encoding: str) -> int:
    """At most how many bytes the vectors of an answer take: tokens (or sentences, when pooled) x layers or
    mixes x (dim x bytes per number of the encoding, + 3 for a vector's brackets or quotes and a comma); the
    tokens echoed back are bounded by the body."""
    vectors = (len(token_counts) if pooled else sum(token_counts)) * outputs
    return math.ceil(vectors * (dim * BYTES_PER_NUMBER[encoding] + 3))


def json_response(payload, status: int = 200, headers: dict | None = None) -> Response:
    # orjson writes numpy arrays directly, many times faster than json + tolist() for large answers.
    body = orjson.dumps(payload, option=orjson.OPT_SERIALIZE_NUMPY, default=_base64_text)
    return Response(body, status_code=status, media_type="application/json", headers=headers)


async def respond(build: Callable[[], dict], estimated_bytes: int) -> Response:
    """The JSON of `build()`: built and encoded here when its answer is estimated small; otherwise built (the
    mixes are numpy work too) and encoded in a worker thread, in pieces between which the event loop runs,
    then sent in parts with its length."""
    if estimated_bytes <= OFF_LOOP_BYTES:
        return json_response(build())
    parts = await asyncio.to_thread(lambda: encode_in_parts(build()))
    length = sum(map(len, parts))

    async def body():
        while parts:
            yield parts.popleft()  # sent parts are freed as it goes

    return StreamingResponse(body(), media_type="application/json", headers={"content-length": str(length)})


def encode_in_parts(payload) -> deque[bytes]:
    """The bytes json_response would write, as parts of about SEND_BYTES, from orjson calls of at most
    PIECE_NUMBERS numbers each."""
    parts: deque[bytes] = deque()
    buffer, size = [], 0
    for piece in _pieces(payload):
        buffer.append(piece)
        size += len(piece)
        if size >= SEND_BYTES:
            parts.append(b"".join(buffer))
            buffer, size = [], 0
    if buffer:
        parts.append(b"".join(buffer))
    return parts


def _base64_text(obj):
    if isinstance(obj, Base64):
        return obj.text()
    raise TypeError(f"{type(obj).__name__} is not JSON serializable")


def _pieces(obj) -> Iterator[bytes]:
    if isinstance(obj, dict):
        yield b"{"
        for k, (key, value) in enumerate(obj.items()):
            yield (b"," if k else b"") + orjson.dumps(key) + b":"
            yield from _pieces(value)
        yield b"}"
    elif isinstance(obj, list) and any(isinstance(x, (dict, list, np.ndarray, Base64)) for x in obj):
        yield b"["
        for k, item in enumerate(obj):
            if k:
                yield b","
            yield from _pieces(item)
        yield b"]"
    elif isinstance(obj, np.ndarray):
        yield from _array(np.ascontiguousarray(obj))
    elif isinstance(obj, Base64):
        data = memoryview(obj.array).cast("B")
        step = 3 * PIECE_NUMBERS  # a multiple of 3 bytes: the base64 of the parts, joined, is that of the whole
        yield b'"'
        for k in range(0, len(data), step):
            yield base64.b64encode(data[k : k + step])
        yield b'"'
    else:
        yield orjson.dumps(obj)


def _array(a: np.ndarray) -> Iterator[bytes]:
    if a.ndim == 0 or a.size <= PIECE_NUMBERS:
        yield orjson.dumps(a, option=orjson.OPT_SERIALIZE_NUMPY)
        return
    row = a.size // len(a)  # numbers per entry along the first axis
    yield b"["
    if row > PIECE_NUMBERS:
        for k, entry in enumerate(a):
            if k:
                yield b","
            yield from _array(entry)
    else:
        step = PIECE_NUMBERS // row
        for k in range(0, len(a), step):
            if k:
                yield b","
            yield orjson.dumps(a[k : k + step], option=orjson.OPT_SERIALIZE_NUMPY)[1:-1]  # its entries, unbracketed
    yield b"]"
