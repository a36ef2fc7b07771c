"""What goes over the wire: request bodies, and the arrays in the answers. The only module that knows the
encoding, so a faster one (a binary body) changes this file alone."""

from __future__ import annotations

import base64
import io
import json
from collections.abc import Sequence

import numpy as np

# The fastest JSON encoding: little-endian float32 in C order, as base64 inside the JSON answer.
ENCODING = "base64"
# Faster still where the server offers it (its /info lists it): the answer as an .npz, numpy.savez's zip of .npy
# files, `embedding_<index>` per item and `answer.json`, the JSON answer without the embeddings.
NPZ = "application/x-npz"
JSON = "application/json"


def accept(info: dict, path: str) -> str:
    """The Accept header for an answer of `path`: the .npz where the server's /info offers it there."""
    return f"{NPZ}, {JSON};q=0.5" if NPZ in (info.get("answer_media_types") or {}).get(path, ()) else JSON


def _dumps(value) -> bytes:
    # Compact and UTF-8 (not \u escapes), so that what the body-size plan counts is what is sent.
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()


def embed_body(sentences: Sequence, options: dict) -> bytes:
    return _dumps({"sentences": list(sentences), **options, "encoding": ENCODING})


def tokenize_body(sentences: Sequence, options: dict) -> bytes:
    return _dumps({"sentences": list(sentences), **options})


def sentence_bytes(sentence: str | Sequence[str]) -> int:
    """The bytes a sentence adds to a body, its separating comma included."""
    return len(_dumps(sentence)) + 1


def answer(content: bytes, content_type: str) -> dict:
    """An answer body (JSON, or the .npz), as the JSON answer; from an .npz, each item's `embedding` is its
    array already."""
    if content_type.split(";")[0].strip().lower() != NPZ:
        return json.loads(content)
    with np.load(io.BytesIO(content), allow_pickle=False) as npz:
        whole = json.loads(npz["answer.json"])
        for item in whole["data"]:
            item["embedding"] = npz[f"embedding_{item['index']}"]
    return whole


def decode(item: dict) -> np.ndarray:
    """An answer item's embedding as a writable array of the item's `shape`: float32, or float16 where the
    request asked for `dtype` float16 (the item's `dtype` then says so, and an .npz member is float16)."""
    embedding = item["embedding"]
    if isinstance(embedding, np.ndarray):
        kind = np.float16 if embedding.dtype.itemsize == 2 else np.float32
        array = embedding.astype(kind, copy=not embedding.flags.writeable)
    else:
        half = item.get("dtype") == "float16"
        array = np.frombuffer(base64.b64decode(embedding), dtype="<f2" if half else "<f4")
        array = array.astype(np.float16 if half else np.float32)
    return array.reshape(item["shape"])
