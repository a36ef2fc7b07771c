"""Raw text -> tokens for requests that send strings: the Moses tokenizer (sacremoses), the kind of
tokenization the published ELMo training data (the 1B Word Benchmark) was made with."""

from __future__ import annotations

from functools import lru_cache

from sacremoses import MosesTokenizer


@lru_cache(maxsize=1)
def _moses() -> MosesTokenizer:
    return MosesTokenizer(lang="en")


def tokenize(text: str) -> list[str]:
    # escape=False: keep `"` and `&` as they are, not as HTML entities, so tokens read like the text.
    return _moses().tokenize(text, escape=False, aggressive_dash_splits=False)
