"""The published ELMo character mapping: token -> UTF-8 bytes -> char ids.

Every released ELMo was trained on these ids, so they must match bilm-tf / allennlp exactly:

* a token is its UTF-8 bytes (characters that cannot be encoded, e.g. lone surrogates, are dropped),
  truncated so that the bytes plus the begin/end-of-word markers fit in `max_characters_per_token`;
* the row is `[BOW, bytes..., EOW, PAD, PAD, ...]` and every id is shifted by +1, so id 0 means
  "no token here" (batch padding);
* the sentence-boundary tokens `<S>` / `</S>` get their own reserved ids instead of their bytes.
"""

from __future__ import annotations

import numpy as np

MAX_CHARS = 50  # max_characters_per_token of every published model
BOS_CHAR = 256  # begin of sentence
EOS_CHAR = 257  # end of sentence
BOW_CHAR = 258  # begin of word
EOW_CHAR = 259  # end of word
PAD_CHAR = 260  # padding inside a word

BOS_TOKEN = "<S>"
EOS_TOKEN = "</S>"


def _marker_row(char: int, max_chars: int) -> np.ndarray:
    row = np.full(max_chars, PAD_CHAR, dtype=np.int32)
    row[:3] = (BOW_CHAR, char, EOW_CHAR)
    return row + 1


def char_key(token: str, max_chars: int = MAX_CHARS) -> str | bytes:
    """What a token's char ids depend on, and nothing more: the boundary tokens' own spelling, else the UTF-8
    bytes that the mapping keeps (at most `max_chars - 2`). Tokens with equal keys get equal ids, so equal
    vectors; the key of a token of a million characters is 48 bytes."""
    if token in (BOS_TOKEN, EOS_TOKEN):
        return token
    return token.encode("utf-8", "ignore")[: max_chars - 2]


def token_bytes(token: str, max_chars: int = MAX_CHARS) -> tuple[int, int]:
    """A token's UTF-8 bytes, and how many of them (its first ones) its char ids keep: at most `max_chars - 2`."""
    utf8 = len(token.encode("utf-8", "ignore"))
    return utf8, min(utf8, max_chars - 2)


def key_char_ids(key: str | bytes, max_chars: int = MAX_CHARS) -> np.ndarray:
    """Char ids of a `char_key`, shape (max_chars,), int32, already shifted by +1."""
    if key == BOS_TOKEN:
        return _marker_row(BOS_CHAR, max_chars)
    if key == EOS_TOKEN:
        return _marker_row(EOS_CHAR, max_chars)
    data = key[: max_chars - 2]
    row = np.full(max_chars, PAD_CHAR, dtype=np.int32)
    row[0] = BOW_CHAR
    row[1 : len(data) + 1] = np.frombuffer(data, dtype=np.uint8)
    row[len(data) + 1] = EOW_CHAR
    return row + 1


def token_char_ids(token: str, max_chars: int = MAX_CHARS) -> np.ndarray:
    """Char ids of one token, shape (max_chars,), int32, already shifted by +1."""
    return key_char_ids(char_key(token, max_chars), max_chars)


def sentence_char_ids(tokens: list[str], max_chars: int = MAX_CHARS) -> np.ndarray:
    """Char ids of `<S> tokens </S>`, shape (len(tokens) + 2, max_chars)."""
    rows = [token_char_ids(t, max_chars) for t in [BOS_TOKEN, *tokens, EOS_TOKEN]]
    return np.stack(rows)
