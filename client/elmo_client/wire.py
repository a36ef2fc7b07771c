"""What goes over the wire: request bodies, and the arrays in the answers. The only module that knows the
encoding, so a faster one (a binary body) changes this file alone."""

from __future__ import annotations

import base64
import json
from collections.abc import Sequence

import numpy as np

# The fastest encoding the server offers: little-endian float32 in C order, as base64 inside the JSON answer.
ENCODING = "base64"


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


def decode(item: dict) -> np.ndarray:
    """An answer item's embedding as a writable float32 array of the item's `shape`."""
    flat = np.frombuffer(base64.b64decode(item["embedding"]), dtype="<f4")
    return flat.astype(np.float32).reshape(item["shape"])
