"""Answers as JSON, or as an .npz (`Accept: application/x-npz`): their size known before the engine runs
(service/admission.py), and large ones composed and encoded off the event loop, in pieces, so that one large
answer does not hold up every small request behind it.

The .npz body is what `numpy.savez` writes (a zip of .npy files, stored uncompressed): `embedding_<index>.npy`, each
item's float32 array (little-endian, of its `shape`; float16 where the request's `dtype` asks), and `answer.json`,
the JSON answer without the embeddings. `numpy.load` reads it as it is; elsewhere, any zip reader and a 10-line .npy
header parser do."""

from __future__ import annotations

import base64
import io
import re
import time
import zipfile
from collections import deque
from collections.abc import Awaitable, Callable, Iterator
from threading import Event

import numpy as np
import orjson
from fastapi.responses import Response, StreamingResponse

from service.api.cancellation import Abandoned

NPZ = "application/x-npz"
QVALUE = re.compile(r"0(\.[0-9]{0,3})?|1(\.0{0,3})?")
JSON = "application/json"
OFF_LOOP_BYTES = 1 << 20  # answers estimated larger are composed and encoded in a worker thread
# So are answers whose composing reads more numbers than this (layers x mixes x tokens x dim): a pooled answer is
# small, but 8 layer_norm mixes over 30 x 1000 tokens took the event loop 0.85 s. 2^20 numbers: a few ms.
OFF_LOOP_NUMBERS = 1 << 20
# Numbers per orjson call off the loop. orjson holds the GIL for a whole call (0.8 s for 16 M numbers), which
# stops the event loop as surely as running on it would; 65 536 of them take it about 4 ms.
PIECE_NUMBERS = 1 << 16
SEND_BYTES = 1 << 20  # a large answer goes out in parts of about this size


class Base64:
    """An array to be written as one base64 string of its little-endian float32 (or float16) bytes, in C order."""

    __slots__ = ("array",)

    def __init__(self, array: np.ndarray):
        self.array = np.ascontiguousarray(array, dtype="<f2" if array.dtype == np.float16 else "<f4")

    def text(self) -> str:
        return base64.b64encode(self.array.tobytes()).decode("ascii")


def wants_npz(accept: str) -> bool:
    """Whether an Accept header asks for the .npz body: it names application/x-npz itself with a q above 0, and
    at least the q it gives JSON, by the most specific range that covers JSON (application/json, else
    application/*, else */*; RFC 9110 12.5.1). JSON is the answer otherwise."""
    q = {}
    for media_range in accept.split(","):
        media, *params = (part.strip() for part in media_range.split(";"))
        weight = 1.0
        for param in params:
            name, _, value = param.partition("=")
            if name.strip().lower() == "q":
                # a qvalue is 0 to 1 with at most three decimals (RFC 9110 12.4.2): "inf", "nan", "1e3" or "2" are
                # not one, and the range they weigh counts as not acceptable
                weight = float(value) if QVALUE.fullmatch(value.strip()) else 0.0
        q[media.lower()] = max(weight, q.get(media.lower(), 0.0))
    json_q = next((q[m] for m in (JSON, "application/*", "*/*") if m in q), 0.0)
    return q.get(NPZ, 0.0) > 0 and q[NPZ] >= json_q


def npz_body(payload: dict) -> memoryview:
    """`payload` (an answer whose `data` items hold their `embedding` as an array) as an .npz: what
    numpy.savez writes, uncompressed (floats do not compress)."""
    buffer = io.BytesIO()
    items = []
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_STORED, allowZip64=True) as npz:
        for item in payload["data"]:
            embedding = item["embedding"]  # float32, or float16 where the request asked for it
            array = np.ascontiguousarray(embedding, dtype="<f2" if embedding.dtype == np.float16 else "<f4")
            with npz.open(f"embedding_{item['index']}.npy", "w", force_zip64=True) as member:
                np.lib.format.write_array(member, array, allow_pickle=False)
            items.append({key: value for key, value in item.items() if key != "embedding"})
        npz.writestr("answer.json", orjson.dumps({**payload, "data": items}))
    return buffer.getbuffer()


def json_response(payload, status: int = 200, headers: dict | None = None) -> Response:
    # orjson writes numpy arrays directly, many times faster than json + tolist() for large answers.
    body = orjson.dumps(payload, option=orjson.OPT_SERIALIZE_NUMPY, default=_base64_text)
    return Response(body, status_code=status, media_type="application/json", headers=headers)


Observe = Callable[[str, float], None]  # a stage's name and its CPU seconds
Build = Callable[[Event | None], dict]  # the answer; it stops early (Abandoned) once the event is set
# Runs a function of a stop event in a worker pool: the app's, which sets the event when the client has gone.
Offload = Callable[[Callable[[Event], object]], Awaitable]


def _timed(build: Build, encode: Callable, observe: Observe | None, stop: Event | None = None):
    """`encode(build())`, with the CPU time of each (of the thread running them) told to `observe`."""
    start = time.thread_time()
    payload = build(stop)
    built = time.thread_time()
    encoded = encode(payload, stop) if encode is encode_in_parts else encode(payload)
    if observe is not None:
        observe("compose", built - start)
        observe("encode", time.thread_time() - built)
    return encoded


async def respond(
    build: Build,
    estimated_bytes: int,
    npz: bool = False,
    observe: Observe | None = None,
    headers: dict | None = None,
    numbers: int = 0,
    offload: Offload | None = None,
) -> Response:
    """The JSON (with `npz`, the .npz) of `build()`: built and encoded here when its answer is estimated small and
    composing it reads at most OFF_LOOP_NUMBERS `numbers`; otherwise built (the mixes are numpy work too) and
    encoded by `offload` in a worker thread (JSON in pieces between which the event loop runs, and which stop once
    the client has gone; the .npz whole, then cut into parts there too), then sent in parts with its length."""
    here = (estimated_bytes <= OFF_LOOP_BYTES and numbers <= OFF_LOOP_NUMBERS) or offload is None
    if npz:
        if here:
            return Response(bytes(_timed(build, npz_body, observe)), media_type=NPZ, headers=headers)
        parts = await offload(lambda stop: _in_parts(_timed(build, npz_body, observe, stop)))
        media = NPZ
    elif here:
        response = _timed(build, json_response, observe)
        response.headers.update(headers or {})
        return response
    else:
        parts = await offload(lambda stop: _timed(build, encode_in_parts, observe, stop))
        media = JSON
    length = sum(map(len, parts))

    async def body():
        while parts:
            yield parts.popleft()  # sent parts are freed as it goes

    return StreamingResponse(body(), media_type=media, headers={"content-length": str(length), **(headers or {})})


def _in_parts(whole: memoryview) -> deque[bytes]:
    # Copying 49 MB into parts took the event loop 27 ms: done in the worker thread, before the loop sends them.
    return deque(bytes(whole[k : k + SEND_BYTES]) for k in range(0, len(whole), SEND_BYTES))


def encode_in_parts(payload, stop: Event | None = None) -> deque[bytes]:
    """The bytes json_response would write, as parts of about SEND_BYTES, from orjson calls of at most
    PIECE_NUMBERS numbers each; Abandoned once `stop` is set."""
    parts: deque[bytes] = deque()
    buffer, size = [], 0
    for piece in _pieces(payload):
        if stop is not None and stop.is_set():
            raise Abandoned
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
