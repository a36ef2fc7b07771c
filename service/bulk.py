"""elmo-embed: embed a file of sentences into an hdf5 file, the layout of allennlp's `elmo --all`.

The input is streamed: a chunk of lines is read, length-sorted and cut into batches whose padded size
(sentences x longest sentence, boundary tokens included) stays under the token budget, embedded, and
written before the next chunk is read. Output: dataset "<line index>" (num_layers, n_tokens, dim) float32
per line, and "sentence_to_index", a JSON object from sentence text to line index.

Sharding (`--shard i/n`) splits one input between n jobs without a pass over the file: line k (0-based)
belongs to shard k mod n. A shard's output keeps the original line indexes as dataset names and in
sentence_to_index, so the n outputs are disjoint and together hold every line exactly once.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np
from tqdm import tqdm

from service.engine import Engine

CHUNK_BATCHES = 32  # sort this many batches' worth of lines at a time: little padding, bounded memory


class InputError(ValueError):
    """A line of the input file that cannot be embedded; the message names the line."""


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


def read_sentences(path: str | Path, shard: Shard = ALL_LINES) -> Iterator[tuple[int, list[str], str, int]]:
    """(line index, tokens, text, bytes read) per line of the shard, from a .txt (whitespace-tokenized) or
    .jsonl (JSON list of tokens). Line indexes count from 0; bytes read include the other shards' lines
    since the last one yielded. Lines of other shards are skipped unread: a bad line stops only its shard."""
    path = Path(path)
    jsonl = path.suffix == ".jsonl"
    skipped = 0
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            if number - 1 not in shard:
                skipped += len(raw)
                continue
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise InputError(f"{path}:{number}: not UTF-8 ({err.reason} at byte {err.start})") from None
            if jsonl:
                try:
                    tokens = json.loads(line)
                except json.JSONDecodeError as err:
                    raise InputError(f"{path}:{number}: not JSON ({err.msg})") from None
                if not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens):
                    raise InputError(f"{path}:{number}: expected a JSON list of token strings")
                text = " ".join(tokens)
            else:
                text = line.strip()
                tokens = text.split()
            if not tokens:
                raise InputError(f"{path}:{number}: empty sentence")
            yield number - 1, tokens, text, skipped + len(raw)
            skipped = 0


def plan_batches(lengths: Iterable[int], batch_tokens: int) -> list[list[int]]:
    """Group sentence positions, longest first, so that rows x (longest + 2) <= batch_tokens."""
    lengths = list(lengths)
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches: list[list[int]] = []
    for i in order:
        if batches and (len(batches[-1]) + 1) * (lengths[batches[-1][0]] + 2) <= batch_tokens:
            batches[-1].append(i)
        else:
            batches.append([i])  # a sentence longer than the budget still goes, alone
    return batches


def embed_file(
    engine: Engine,
    input_path: str | Path,
    output_path: str | Path,
    batch_tokens: int = 4096,
    progress: bool = True,
    shard: Shard = ALL_LINES,
) -> dict:
    """Embed every line of input_path (of the shard) into output_path; returns counts and timing."""
    output_path = Path(output_path)
    partial = output_path.with_name(output_path.name + ".partial")
    sentence_to_index: dict[str, str] = {}
    sentences = tokens_total = 0
    started = time.perf_counter()
    desc = "elmo-embed" if shard == ALL_LINES else f"elmo-embed {shard}"
    size = os.path.getsize(input_path)
    bar = tqdm(total=size, unit="B", unit_scale=True, disable=not progress, desc=desc)
    try:
        with h5py.File(partial, "w") as out:
            for chunk in _chunks(read_sentences(input_path, shard), CHUNK_BATCHES * batch_tokens):
                for batch in plan_batches((len(line[1]) for line in chunk), batch_tokens):
                    layers = engine.run([chunk[i][1] for i in batch])
                    for i, array in zip(batch, layers, strict=True):
                        out.create_dataset(str(chunk[i][0]), data=array)
                for line_index, tokens, text, read in chunk:
                    sentence_to_index[text] = str(line_index)
                    sentences += 1
                    tokens_total += len(tokens)
                    bar.update(read)
                bar.set_postfix(tokens_per_s=f"{tokens_total / (time.perf_counter() - started):.0f}")
            bar.update(size - bar.n)  # the other shards' lines after this shard's last one
            index = out.create_dataset("sentence_to_index", (1,), dtype=h5py.string_dtype())
            index[0] = json.dumps(sentence_to_index)
        os.replace(partial, output_path)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    finally:
        bar.close()
    seconds = time.perf_counter() - started
    return {"sentences": sentences, "tokens": tokens_total, "seconds": seconds, "tokens_per_s": tokens_total / seconds}


def _chunks(
    lines: Iterator[tuple[int, list[str], str, int]], chunk_tokens: int
) -> Iterator[list[tuple[int, list[str], str, int]]]:
    chunk, tokens = [], 0
    for line in lines:
        chunk.append(line)
        tokens += len(line[1])
        if tokens >= chunk_tokens:
            yield chunk
            chunk, tokens = [], 0
    if chunk:
        yield chunk


def read_embeddings(path: str | Path) -> tuple[dict[int, np.ndarray], dict[str, str]]:
    """All of an elmo-embed output file: line index -> layers, in line order, and sentence_to_index (for tests
    and small files). A shard's file holds only its own lines."""
    with h5py.File(path, "r") as f:
        index = json.loads(f["sentence_to_index"][0])
        lines = sorted(int(name) for name in f if name != "sentence_to_index")
        return {line: f[str(line)][...] for line in lines}, index
