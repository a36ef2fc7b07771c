"""elmo-embed's input files: named by paths or globs, read as spans of whole lines that keep each line's index.

A line's index counts from 0 over the inputs in the order given (a second file's first line follows the first file's
last), whichever job reads it: the local run, a `--shard`, or a part of a Ray run. `split` cuts the inputs into spans
of about `lines` lines each by counting newlines (numpy over 8 MB blocks: about 1 GB/s, no line is parsed), so a
cluster's workers can each read their own byte range without a pass over what comes before it.
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

SCAN_BYTES = 8 << 20


class InputError(ValueError):
    """A line of an input file that cannot be embedded; the message names the file and line."""


@dataclass(frozen=True)
class Shard:
    """Shard `index` of `count` (0 <= index < count): the lines k with k mod count == index."""

    index: int = 0
    count: int = 1

    def __post_init__(self):
        if not 0 <= self.index < self.count:
            raise ValueError(f"{self.index}/{self.count}: expected i/n with 0 <= i < n (shards count from 0)")

    @classmethod
    def parse(cls, text: str) -> Shard:
        """The shard written "i/n" on the command line, e.g. "0/4" for the first of four."""
        index, slash, count = text.partition("/")
        if not (slash and index.isdecimal() and count.isdecimal()):
            raise ValueError(f"{text!r}: expected i/n, two whole numbers with 0 <= i < n (e.g. 0/4)")
        return cls(int(index), int(count))

    def __contains__(self, line_index: int) -> bool:
        return line_index % self.count == self.index

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"


ALL_LINES = Shard()


@dataclass(frozen=True)
class Span:
    """The whole lines of `path` from byte `start` to byte `end` (None: the file's end), the first of which is line
    `first_line` of the job (counted from 0 over all its inputs)."""

    path: str
    start: int = 0
    end: int | None = None
    first_line: int = 0
    lines: int | None = None  # how many, where `split` counted them
    line_number: int = 1  # its first line's number in its file (from 1), for the messages naming a bad line

    @property
    def size(self) -> int:
        return (os.path.getsize(self.path) if self.end is None else self.end) - self.start


def expand(patterns: Sequence[str]) -> list[str]:
    """The input files: each pattern a path, or a glob (sorted) where no file has that very name; refused if a
    pattern names nothing, or a folder."""
    paths: list[str] = []
    for pattern in patterns:
        found = [pattern] if os.path.exists(pattern) else sorted(glob.glob(pattern))
        if not found:
            raise FileNotFoundError(f"{pattern}: no such file (nor files matching it)")
        for path in found:
            if os.path.isdir(path):
                raise InputError(f"{path}: a folder; give the files in it (e.g. '{path}/*.txt')")
        paths += found
    return paths


def split(paths: Sequence[str], lines: int) -> list[Span]:
    """The inputs as spans of at most `lines` lines (the last of each file may be shorter; an empty file has none),
    in order, with their first lines' global indexes. A last line without a newline counts, as in reading."""
    if lines < 1:
        raise ValueError("a part holds at least one line")
    spans: list[Span] = []
    first_line = 0
    for path in paths:
        starts = [0]  # the byte offsets where a span begins
        count = position = 0
        with open(path, "rb") as f:
            while block := f.read(SCAN_BYTES):
                for newline in np.flatnonzero(np.frombuffer(block, np.uint8) == 0x0A):
                    count += 1
                    if count % lines == 0:
                        starts.append(position + int(newline) + 1)
                position += len(block)
            if position > 0:
                f.seek(position - 1)
                count += f.read(1) != b"\n"  # a last line without a newline
        if starts[-1] == position:  # the file ends where a span would start
            starts.pop()
        for i, start in enumerate(starts):
            end = starts[i + 1] if i + 1 < len(starts) else position
            n = min(lines, count - i * lines)
            spans.append(Span(path, start, end, first_line + i * lines, n, i * lines + 1))
        first_line += count
    return spans


def whole_files(paths: Sequence[str]) -> list[Span]:
    """The inputs, a span each, with their first lines' global indexes (a pass over each file but the last)."""
    if len(paths) == 1:
        return [Span(paths[0])]
    spans, first_line = [], 0
    for span in split(paths, 1 << 62):
        spans.append(Span(span.path, 0, None, first_line, span.lines))
        first_line += span.lines or 0
    return spans


BadLine = Callable[[str, int, int, str], None]  # (path, line number from 1, line index, reason)


def read_sentences(
    spans: str | Path | Sequence[Span], shard: Shard = ALL_LINES, on_bad: BadLine | None = None
) -> Iterator[tuple[int, list[str], str, int]]:
    """(line index, tokens, text, bytes read) per line of the shard, from .txt (whitespace-tokenized) or .jsonl (a
    JSON list of tokens) spans. Bytes read include the other shards' lines since the last one yielded. Lines of other
    shards are skipped unread: a bad line stops only its shard. A bad line raises InputError naming it, or, with
    `on_bad`, is handed to it and skipped."""
    for span in [Span(str(spans))] if isinstance(spans, str | Path) else spans:
        yield from _span_sentences(span, shard, on_bad)


def _span_sentences(span: Span, shard: Shard, on_bad: BadLine | None) -> Iterator[tuple[int, list[str], str, int]]:
    path = Path(span.path)
    jsonl = path.suffix == ".jsonl"
    skipped = 0
    with open(path, "rb") as f:
        f.seek(span.start)
        position = span.start
        for offset, raw in enumerate(f):
            if span.end is not None and position >= span.end:
                break
            position += len(raw)
            line_index = span.first_line + offset
            if line_index not in shard:
                skipped += len(raw)
                continue
            where = f"{path}:{span.line_number + offset}"
            try:
                tokens, text = _parse(raw, jsonl, where)
            except InputError as err:
                if on_bad is None:
                    raise
                on_bad(str(path), span.line_number + offset, line_index, str(err).removeprefix(f"{where}: "))
                skipped += len(raw)
                continue
            yield line_index, tokens, text, skipped + len(raw)
            skipped = 0


def _parse(raw: bytes, jsonl: bool, where: str) -> tuple[list[str], str]:
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise InputError(f"{where}: not UTF-8 ({err.reason} at byte {err.start})") from None
    if jsonl:
        try:
            tokens = json.loads(line)
        except json.JSONDecodeError as err:
            raise InputError(f"{where}: not JSON ({err.msg})") from None
        if not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens):
            raise InputError(f"{where}: expected a JSON list of token strings")
        text = " ".join(tokens)
    else:
        text = line.strip()
        tokens = text.split()
    if not tokens:
        # allennlp 0.9's `elmo` refuses the whole file too (ConfigurationError naming the empty lines)
        raise InputError(f"{where}: empty sentence (remove the line, as allennlp asks)")
    return tokens, text
