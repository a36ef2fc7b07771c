"""Raw text -> tokens for requests that send strings: the Moses tokenizer (sacremoses), the kind of
tokenization the published ELMo training data (the 1B Word Benchmark) was made with. Before Moses runs, two
cheap bounds on the tokens it would make decide whether a text is refused: Moses never runs on one that is."""

from __future__ import annotations

import re
from collections.abc import Callable
from functools import lru_cache
from itertools import islice

from sacremoses import MosesTokenizer
from sacremoses.corpus import NonbreakingPrefixes

# A word by whitespace that keeps a character once Moses has deleted the ASCII control characters (it makes
# whitespace single spaces first): from its first such character to the word's end, so each is matched once.
_WORD = re.compile(r"[^\s\x00-\x1f]\S*")
# A run of the characters Moses keeps together (its own IsAlnum class), or any one other visible character.
_PIECE = re.compile(rf"[{MosesTokenizer.IsAlnum}]+|[^{MosesTokenizer.IsAlnum}\s]")

# An ASCII text's characters as the two bounds see them, so that bytes' C loops count them (the regexes' matches,
# one Python object each, took 0.46 s of the event loop for a truncate of 62 texts of 15,900 words): for
# max_tokens, a letter or digit (Moses' IsAlnum, in ASCII) is "a", whitespace (str.isspace, as `\s`) " ", any
# other character "."; for min_tokens the same, the control characters Moses deletes left out.
_SPACE = bytes(c for c in range(128) if chr(c).isspace())
_CLASSES = bytes.maketrans(bytes(range(128)), b"".join(
    b"a" if chr(c).isalnum() else b" " if c in _SPACE else b"." for c in range(128)
))  # fmt: skip
_DELETED = bytes(c for c in range(32) if c not in _SPACE)


def _runs(classes: bytes) -> int:
    """How many runs of "a" `classes` holds: one at its start, and one after each byte of another class."""
    return classes.startswith(b"a") + classes.count(b" a") + classes.count(b".a")


def _words(ascii: bytes) -> int:
    return _runs(ascii.translate(_CLASSES, _DELETED).replace(b".", b"a"))


def _pieces(ascii: bytes) -> int:
    classes = ascii.translate(_CLASSES)
    return classes.count(b".") + _runs(classes)


def _ascii_count(text: str, stop: int | None, count: Callable[[bytes], int]) -> int:
    """`count` of an ASCII text, no more than `stop`: of its first 2 x `stop` characters first (a word or piece
    and the character that parts it from the next), then of 4 times as many, and so on, so that a text over the
    limit costs about what it takes to reach the limit; cut anywhere, a text has no more words or pieces than
    whole, so what a cut text reaches the whole does."""
    if stop is not None:
        cut = 2 * stop
        while len(text) > cut:
            if count(text[:cut].encode("ascii")) >= stop:
                return stop
            cut *= 4
    found = count(text.encode("ascii"))
    return found if stop is None else min(found, stop)


# The languages whose non-breaking prefixes ("Dr.", "ca.") Moses has; it takes English's for any other code.
LANGUAGES = tuple(sorted(set(NonbreakingPrefixes().available_langs.values())))


class _Moses(MosesTokenizer):
    """sacremoses' tokenizer, with its character-class tests on sets built once: its own build a set of its
    10,862 letters for every token that ends in a full stop (0.9 ms each: `"a.a. " * 4000` took 3.6 s). The
    tests answer the same, so the tokens are the same."""

    def __init__(self, lang: str = "en"):
        super().__init__(lang=lang)
        self._alpha, self._lower = frozenset(self.IsAlpha), frozenset(self.IsLower)  # after CJK letters joined

    def islower(self, text: str) -> bool:
        return self._lower.issuperset(text)

    def isanyalpha(self, text: str) -> bool:
        return not self._alpha.isdisjoint(text)


@lru_cache(maxsize=8)
def _moses(language: str) -> MosesTokenizer:
    return _Moses(lang=language)


def tokenize(text: str, language: str = "en") -> list[str]:
    """Moses' tokens of `text`, with the non-breaking prefixes of `language` (the model's, from its manifest)."""
    # escape=False: keep `"` and `&` as they are, not as HTML entities, so tokens read like the text.
    return _moses(language).tokenize(text, escape=False, aggressive_dash_splits=False)


def min_tokens(text: str, stop: int | None = None) -> int:
    """A lower bound on len(tokenize(text)), in linear time, counted no further than `stop`: Moses first turns
    whitespace into single spaces and deletes the other ASCII control characters, then only ever splits words
    further, so its words left with a character each are at least that many tokens. A request over a limit is
    refused with this before any (much slower) tokenization."""
    if text.isascii():  # most texts: counted in C
        return _ascii_count(text, stop, _words)
    return sum(1 for _ in islice(_WORD.finditer(text), stop))


def max_tokens(text: str, stop: int | None = None) -> int:
    """An upper bound on len(tokenize(text)), counted no further than `stop`: its runs of letters and digits
    plus its other non-space characters. Moses (with escape and aggressive dash splits off) only inserts
    spaces, deletes control characters and turns dot runs into a marker and back: every split it makes is
    next to a character outside its IsAlnum class, so a run of those is at most one token on its own, and
    every other token holds at least one other character. `"a," * 4_000_000` is one word and 8 000 000
    tokens; counting stops at `stop`, so a text over a limit costs no more than the limit to refuse."""
    if text.isascii():
        return _ascii_count(text, stop, _pieces)
    return sum(1 for _ in islice(_PIECE.finditer(text), stop))


def word_end(text: str, words: int) -> int | None:
    """Where the text's `words`-th word by whitespace ends, if more words follow; None if it has no more words
    than that. Linear, and stops there: a text of 16,000 words cut after 1,016 costs what those do."""
    found = None
    for k, match in enumerate(_WORD.finditer(text)):
        if k == words:
            return found
        found = match.end()
    return None
