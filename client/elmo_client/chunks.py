"""Inputs of any size as requests under the limits a server reports in /info: consecutive runs of sentences, so
that the answers, put back together in order, are the input's."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from elmo_client.wire import sentence_bytes

BOUNDARY_TOKENS = 2  # <S> and </S>: the server's queue counts them for every sentence


@dataclass(frozen=True)
class Limits:
    """The server's request limits (/info's `limits`); the defaults are the server's own."""

    max_sentences: int = 512
    max_tokens_per_sentence: int = 1000
    max_body_bytes: int = 8 << 20
    queue_tokens: int = 65536

    @classmethod
    def from_info(cls, info: dict) -> Limits:
        limits = info.get("limits", {})
        return cls(**{name: int(limits[name]) for name in cls.__dataclass_fields__ if name in limits})


def estimated_tokens(sentence: str | Sequence[str]) -> int:
    """A token list's length; a text's words, the count the server itself checks first. Moses may split a
    word further ("don't," is three tokens): a request that turns out too large is answered 413 and split."""
    return len(sentence.split()) if isinstance(sentence, str) else len(sentence)


def plan(
    sentences: Sequence[str | Sequence[str]], limits: Limits, fixed_bytes: int, tokens_per_request: int, truncate: bool
) -> list[range]:
    """Consecutive index ranges covering `sentences`, each at most `max_sentences` long, with a body of at most
    `max_body_bytes` (`fixed_bytes`: the body without sentences) and at most `tokens_per_request` queued tokens.
    A sentence that alone is over a limit gets a request of its own: the server's answer says what is wrong."""
    body_budget = limits.max_body_bytes - fixed_bytes
    runs, start, size, tokens = [], 0, 0, 0
    for i, sentence in enumerate(sentences):
        n = estimated_tokens(sentence)
        n = (min(n, limits.max_tokens_per_sentence) if truncate else n) + BOUNDARY_TOKENS
        b = sentence_bytes(sentence)
        if i > start and (
            i - start >= limits.max_sentences or size + b > body_budget or tokens + n > tokens_per_request
        ):
            runs.append(range(start, i))
            start, size, tokens = i, 0, 0
        size, tokens = size + b, tokens + n
    if start < len(sentences):
        runs.append(range(start, len(sentences)))
    return runs
