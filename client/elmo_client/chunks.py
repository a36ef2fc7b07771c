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
    max_answer_bytes: int = 64 << 20

    @classmethod
    def from_info(cls, info: dict) -> Limits:
        limits = info.get("limits", {})
        return cls(**{name: int(limits[name]) for name in cls.__dataclass_fields__ if name in limits})


def vector_bytes(info: dict, options: dict, encoding: str) -> float:
    """At most the bytes of one token's (or, pooled, one sentence's) vectors in an answer, as the server
    estimates them before it runs (its /info `answer_bytes_per_number`): layers or mixes x (dim x bytes per
    number + 3). 0 when the server does not say (it still answers 413 over its limit, and the request is split)."""
    per_number = (info.get("limits", {}).get("answer_bytes_per_number") or {}).get(encoding)
    if not per_number or "dim" not in info:
        return 0.0
    if options.get("mixes"):
        outputs = len(options["mixes"])
    elif options.get("output") == "layers":
        outputs = len(options["layers"]) if options.get("layers") else int(info["num_layers"])
    else:
        outputs = 1
    return outputs * (int(info["dim"]) * float(per_number) + 3)


def estimated_tokens(sentence: str | Sequence[str]) -> int:
    """A token list's length; a text's words, the count the server itself checks first. Moses may split a
    word further ("don't," is three tokens): a request that turns out too large is answered 413 and split."""
    return len(sentence.split()) if isinstance(sentence, str) else len(sentence)


def plan(
    sentences: Sequence[str | Sequence[str]],
    limits: Limits,
    fixed_bytes: int,
    tokens_per_request: int,
    truncate: bool,
    vector: float = 0.0,
    pooled: bool = False,
    extra_positions: int = 0,
) -> list[range]:
    """Consecutive index ranges covering `sentences`, each at most `max_sentences` long, with a body of at most
    `max_body_bytes` (`fixed_bytes`: the body without sentences), at most `tokens_per_request` queued tokens and
    an answer of at most `max_answer_bytes` (`vector`: the bytes of a token's vectors, a sentence's when
    `pooled`; `extra_positions`: the vectors a sentence's answer has beyond its tokens, 2 with `boundaries`).
    A sentence that alone is over a limit gets a request of its own: the server's answer says what is wrong."""
    body_budget = limits.max_body_bytes - fixed_bytes
    runs, start, size, tokens, answer = [], 0, 0, 0, 0.0
    for i, sentence in enumerate(sentences):
        n = estimated_tokens(sentence)
        n = min(n, limits.max_tokens_per_sentence) if truncate else n
        a = vector * (1 if pooled else n + extra_positions)
        n += BOUNDARY_TOKENS
        b = sentence_bytes(sentence)
        if i > start and (
            i - start >= limits.max_sentences
            or size + b > body_budget
            or tokens + n > tokens_per_request
            or answer + a > limits.max_answer_bytes
        ):
            runs.append(range(start, i))
            start, size, tokens, answer = i, 0, 0, 0.0
        size, tokens, answer = size + b, tokens + n, answer + a
    if start < len(sentences):
        runs.append(range(start, len(sentences)))
    return runs
