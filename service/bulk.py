"""elmo-embed: embed a file of sentences into an hdf5 file, the layout of allennlp's `elmo --all`.

The input is streamed: a chunk of lines is read, length-sorted and cut into batches whose padded size
(sentences x longest sentence, boundary tokens included) stays under the token budget, embedded, and
written before the next chunk is read. Output: dataset "<line index>" (num_layers, n_tokens, dim) float32
per line, and "sentence_to_index", a JSON object from sentence text to line index.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import h5py
import numpy as np
from tqdm import tqdm

from service.engine import Engine

CHUNK_BATCHES = 32  # sort this many batches' worth of lines at a time: little padding, bounded memory


class InputError(ValueError):
    """A line of the input file that cannot be embedded; the message names the line."""


def read_sentences(path: str | Path) -> Iterator[tuple[list[str], str, int]]:
    """(tokens, text, bytes read) per line of a .txt (whitespace-tokenized) or .jsonl (JSON list of tokens)."""
    path = Path(path)
    jsonl = path.suffix == ".jsonl"
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
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
            yield tokens, text, len(raw)


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
    engine: Engine, input_path: str | Path, output_path: str | Path, batch_tokens: int = 4096, progress: bool = True
) -> dict:
    """Embed every line of input_path into output_path; returns counts and timing."""
    output_path = Path(output_path)
    partial = output_path.with_name(output_path.name + ".partial")
    sentence_to_index: dict[str, str] = {}
    sentences = tokens_total = 0
    started = time.perf_counter()
    bar = tqdm(total=os.path.getsize(input_path), unit="B", unit_scale=True, disable=not progress, desc="elmo-embed")
    try:
        with h5py.File(partial, "w") as out:
            for chunk in _chunks(read_sentences(input_path), CHUNK_BATCHES * batch_tokens):
                for batch in plan_batches((len(tokens) for tokens, _, _ in chunk), batch_tokens):
                    layers = engine.run([chunk[i][0] for i in batch])
                    for i, array in zip(batch, layers, strict=True):
                        out.create_dataset(str(sentences + i), data=array)
                for tokens, text, size in chunk:
                    sentence_to_index[text] = str(sentences)
                    sentences += 1
                    tokens_total += len(tokens)
                    bar.update(size)
                bar.set_postfix(tokens_per_s=f"{tokens_total / (time.perf_counter() - started):.0f}")
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
    lines: Iterator[tuple[list[str], str, int]], chunk_tokens: int
) -> Iterator[list[tuple[list[str], str, int]]]:
    chunk, tokens = [], 0
    for line in lines:
        chunk.append(line)
        tokens += len(line[0])
        if tokens >= chunk_tokens:
            yield chunk
            chunk, tokens = [], 0
    if chunk:
        yield chunk


def read_embeddings(path: str | Path) -> tuple[list[np.ndarray], dict[str, str]]:
    """All of an elmo-embed output file, in line order (for tests and small files)."""
    with h5py.File(path, "r") as f:
        index = json.loads(f["sentence_to_index"][0])
        count = len(f) - 1
        return [f[str(i)][...] for i in range(count)], index
