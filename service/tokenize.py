"""Raw text -> tokens for requests that send strings: the Moses tokenizer (sacremoses), the kind of
tokenization the published ELMo training data (the 1B Word Benchmark) was made with."""

from __future__ import annotations

import re
from functools import lru_cache

from sacremoses import MosesTokenizer

_ASCII_JUNK = re.compile(r"[\x00-\x1f]")  # what Moses deletes once whitespace is made single spaces


@lru_cache(maxsize=1)
def _moses() -> MosesTokenizer:
    return MosesTokenizer(lang="en")


def tokenize(text: str) -> list[str]:
    # escape=False: keep `"` and `&` as they are, not as HTML entities, so tokens read like the text.
    return _moses().tokenize(text, escape=False, aggressive_dash_splits=False)


def min_tokens(text: str) -> int:
    """A lower bound on len(tokenize(text)), in linear time: Moses first turns whitespace into single
    spaces and deletes the other ASCII control characters, then only ever splits words further. A request
    over a limit is refused with this before any (much slower) tokenization."""
    return len(_ASCII_JUNK.sub("", " ".join(text.split())).split())
