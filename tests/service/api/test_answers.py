"""Answers encoded in pieces off the event loop are the very bytes of the one-call encoding, and the size
estimated before the engine runs bounds what is written."""

from __future__ import annotations

import base64
import io
import json

import numpy as np
import orjson
import pytest

from service.admission import BYTES_PER_NUMBER, answer_bytes
from service.api import answers as encode
from service.api.answers import PIECE_NUMBERS, Base64, encode_in_parts, json_response, npz_body, respond, wants_npz
from service.api.cancellation import Abandoned

RNG = np.random.default_rng(0)


def arrays() -> list[np.ndarray]:
    return [
        RNG.standard_normal((3, 200, 32)).astype(np.float32),  # per-layer: each layer over a piece
        RNG.standard_normal((5000, 32)).astype(np.float32),  # a mix: rows grouped into pieces
        RNG.standard_normal(100_003).astype(np.float32),  # pooled, one long axis
        RNG.standard_normal((2, 1, 0, 4)).astype(np.float32),  # empty
        np.float32(1.5) * np.ones((1, 1), np.float32),
    ]


@pytest.mark.parametrize("piece_numbers", [1, 7, 1000, 1 << 16])
def test_pieces_join_into_the_one_call_encoding(monkeypatch, piece_numbers):
    monkeypatch.setattr(encode, "PIECE_NUMBERS", piece_numbers)
    monkeypatch.setattr(encode, "SEND_BYTES", 4096)
    data = [
        {"index": i, "tokens": ["a", "é", '"q"'], "embedding": a if i % 2 else Base64(a), "shape": list(a.shape)}
        for i, a in enumerate(arrays())
    ]
    payload = {"model": "m", "dim": 32, "data": data, "usage": {"sentences": 5, "tokens": 15}}
    parts = encode_in_parts(payload)
    assert b"".join(parts) == json_response(payload).body
    assert len(parts) > 1 and all(len(p) < 4096 + 4 * 3 * max(piece_numbers, 32) * 17 for p in parts)


def test_base64_in_pieces_is_the_array_bytes(monkeypatch):
    monkeypatch.setattr(encode, "PIECE_NUMBERS", 10)  # 30 bytes a piece: a multiple of 3
    a = RNG.standard_normal(1001).astype(np.float32)
    text = orjson.loads(b"".join(encode_in_parts({"e": Base64(a)})))["e"]
    assert np.array_equal(np.frombuffer(base64.b64decode(text), "<f4"), a)


@pytest.mark.parametrize("encoding", ["float", "base64"])
def test_the_estimate_bounds_the_numbers_written(encoding):
    # The longest float32 numbers orjson writes, and ordinary ones: the estimate is at least what is written.
    longest = np.full((40, 32), -0.0000037214047, np.float32)
    for a in [longest, RNG.standard_normal((40, 32)).astype(np.float32)]:
        written = len(orjson.dumps(a if encoding == "float" else Base64(a), option=orjson.OPT_SERIALIZE_NUMPY,
                                   default=lambda x: x.text()))  # fmt: skip
        estimate = answer_bytes([40], 32, 1, False, encoding)
        assert written <= estimate
    assert answer_bytes([40, 2], 32, 3, True, encoding) == int(np.ceil(2 * 3 * (32 * BYTES_PER_NUMBER[encoding] + 3)))


def test_npz_is_what_numpy_reads_and_the_estimate_bounds_it():
    data = [{"index": i, "tokens": ["a"], "embedding": a, "shape": list(a.shape)} for i, a in enumerate(arrays())]
    body = npz_body({"model": "m", "data": data})
    npz = np.load(io.BytesIO(body), allow_pickle=False)
    for i, item in enumerate(data):
        np.testing.assert_array_equal(npz[f"embedding_{i}"], item["embedding"])
    assert json.loads(npz["answer.json"])["data"][1] == {k: v for k, v in data[1].items() if k != "embedding"}
    sizes = [a.shape for a in (np.zeros((3, 200, 32)), np.zeros((5000, 32)))]
    small = npz_body({"data": [{"index": i, "embedding": np.zeros(s, np.float32)} for i, s in enumerate(sizes)]})
    assert len(small) <= answer_bytes([200, 5000], 32, 3, False, "npz")


@pytest.mark.parametrize(
    ("accept", "npz"),
    [
        ("", False),
        ("application/json", False),
        ("*/*", False),
        ("application/x-npz", True),
        ("Application/X-NPZ; q=1", True),
        ("application/x-npz;q=0", False),
        ("application/x-npz;q=0.5, application/json", False),
        ("application/x-npz, application/json;q=0.5", True),
        ("application/x-npz;q=nonsense", False),
        ("application/x-npz;q=inf, application/json", False),  # not a qvalue: not acceptable, not above all
        ("application/x-npz;q=inf", False),
        ("application/x-npz;q=1e3, application/json;q=0.9", False),
        ("application/x-npz;q=1.000", True),
        ("application/x-npz;q=0.5, */*", False),  # */* gives JSON q=1
        ("application/x-npz;q=0.5, application/*;q=0.4", True),
        ("application/x-npz;q=0.5, application/json;q=0.4, */*", True),  # the most specific range counts
    ],
)
def test_npz_is_chosen_by_accept(accept, npz):
    assert wants_npz(accept) is npz


@pytest.mark.parametrize(
    ("size", "numbers", "off_loop"),
    [(1000, 1000, False), (2 << 20, 1000, True), (1000, 184_320_000, True)],  # the last: 8 mixes, 30 x 1000 tokens
    ids=["small", "large-answer", "small-answer-of-much-work"],
)
def test_off_the_event_loop_by_the_answer_s_size_or_its_work(size, numbers, off_loop):
    import asyncio
    import threading

    ran = []

    async def offload(work):
        ran.append(threading.current_thread())
        return await asyncio.to_thread(work, threading.Event())

    def build(stop=None):
        return {"data": [{"embedding": np.ones((2, 3), np.float32)}]}

    response = asyncio.run(respond(build, size, numbers=numbers, offload=offload))
    assert bool(ran) is off_loop
    body = response.body if hasattr(response, "body") else None
    if body is not None:
        assert orjson.loads(body) == {"data": [{"embedding": [[1.0] * 3] * 2}]}


def test_encoding_stops_once_the_client_has_gone():
    import threading

    stop = threading.Event()
    stop.set()
    with pytest.raises(Abandoned):
        encode_in_parts({"e": np.ones((4, PIECE_NUMBERS), np.float32)}, stop)
