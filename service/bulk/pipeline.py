"""elmo-embed: embed a file of sentences into an hdf5 file, the layout of allennlp's `elmo --all`.

The input is streamed: a chunk of lines is read, length-sorted and cut into batches whose padded size
(sentences x longest sentence, boundary tokens included) stays under the token budget, embedded and
written, the three overlapped (`embed_file`): the next chunk is read while this one's batches run, and a
batch is written while the next one runs. Output: dataset "<line index>" (num_layers, n_tokens, dim) float32
per line, and "sentence_to_index", a JSON object from sentence text to line index.

Sharding (`--shard i/n`) splits one input between n jobs without a pass over the file: line k (0-based)
belongs to shard k mod n. A shard's output keeps the original line indexes as dataset names and in
sentence_to_index, so the n outputs are disjoint and together hold every line exactly once.

`Output` chooses what is written, as allennlp's `elmo` command's flags do: every layer, the top one or their
mean; line indexes or the sentences themselves as dataset names; sentence_to_index or not.
"""

from __future__ import annotations

import contextlib
import glob
import json
import math
import os
import queue
import secrets
import socket
import threading
import time
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np
from tqdm import tqdm

from service.bulk.hdf5_writer import PENDING, Stopped, WriterProcess, create_file, dataset_writer, finish_file
from service.bulk.inputs import ALL_LINES, BadLine, InputError, Shard, Span, read_sentences
from service.engine.packing import PackedRows
from service.engine.session import Engine

CHUNK_BATCHES = 32  # sort this many batches' worth of lines at a time: little padding, bounded memory


@dataclass(frozen=True)
class Output:
    """What each line's dataset holds and how it is named, with allennlp 0.9's `elmo` flags' meaning: `layers`
    "all" (num_layers, n_tokens, dim), "top" (the last layer) or "average" (the layers' mean), (n_tokens, dim);
    `sentence_keys`: the stripped line is the dataset's name (a repeated line is an error, as in allennlp) and
    there is no sentence_to_index; `forget_sentences`: no sentence_to_index."""

    layers: str = "all"
    sentence_keys: bool = False
    forget_sentences: bool = False
    format: str = "hdf5"  # or "parquet": a Parquet file of a row per line (service/bulk/parquet.py)
    about: str = ""  # JSON: the model and flags that made the file (its "elmo_embed" attribute; `merge` reads it)

    def select(self, layers: np.ndarray) -> np.ndarray:
        if self.layers == "top":
            return layers[-1]
        if self.layers == "average":
            return np.average(layers, axis=0)  # as allennlp: numpy's mean of the float32 layers
        return layers


ALL_LAYERS = Output()


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
    source: str | Path | Sequence[Span],
    output_path: str | Path,
    batch_tokens: int = 4096,
    progress: bool = True,
    shard: Shard = ALL_LINES,
    output: Output = ALL_LAYERS,
    dtype: str = "float32",
    writer: str = "auto",
    on_bad: BadLine | None = None,
) -> dict:
    """Embed every line of `source` (an input file, or spans of input files: service/bulk/inputs.py) of the shard
    into output_path, each dataset of `dtype` (float32, or float16: half the bytes); returns counts and timing.
    A bad line stops the run naming it, or, with `on_bad`, is handed to it and skipped.

    The output appears whole or not at all: it is written to a file of an unpredictable name beside it, created
    exclusively (never through a link planted there), synced to disk with its folder, and renamed over output_path.

    `writer` "process": the hdf5 file is written by a process of its own (`WriterProcess`), fed through shared
    memory, so that h5py's time per dataset does not share this process's interpreter lock with the pipeline;
    "thread": by a thread of this process (the same file, dataset by dataset); "auto" (the default): the process
    where this process may run on at least WRITER_PROCESS_CORES cores. On 2 cores it measured slower: the pipeline's
    own threads keep both busy, and the process costs more CPU in all (docs/gpu.md).

    Four threads, so that the engine never waits on the file system, the parser or the copies: a reader parses
    the next chunks and plans their batches (at most READ_AHEAD_CHUNKS ahead), this thread runs the engine, an
    assembler puts each finished sentence's layers together (its only copy, numpy's, which runs beside the
    others), and a writer writes them to hdf5 (each at most WRITE_BEHIND_BATCHES behind). The writer is the only
    thread that touches the file, h5py not being safe for concurrent use. ONNX Runtime releases the GIL while it
    runs, so on a GPU the others work while the device does. The first failure in any of them (a bad line, an
    engine error, a full disk, KeyboardInterrupt) stops all four and removes the .partial."""
    output_path = Path(output_path)
    spans = [Span(str(source))] if isinstance(source, str | Path) else list(source)
    refuse_output(output_path)
    sweep_partials(output_path)
    partial = partial_name(output_path)
    started = time.perf_counter()
    desc = "elmo-embed" if shard == ALL_LINES else f"elmo-embed {shard}"
    bar = tqdm(total=sum(span.size for span in spans), unit="B", unit_scale=True, disable=not progress, desc=desc)
    stop = threading.Event()
    planned: queue.Queue = queue.Queue(READ_AHEAD_CHUNKS)
    finished: queue.Queue = queue.Queue(WRITE_BEHIND_BATCHES)
    assembled: queue.Queue = queue.Queue(WRITE_BEHIND_BATCHES)
    reader = _Stage(stop, _read_ahead, spans, shard, batch_tokens, planned, stop, on_bad)
    early = _assembled_dtype(output, dtype)
    in_process = _writer_process_chosen(writer) and output.format == "hdf5"
    process, stages = None, (reader,)
    try:
        process = WriterProcess(partial, output, stop) if in_process else None
        assembler, writing = _assembler_and_writer(engine, partial, output, np.dtype(dtype), early, process,
                                                   (finished, assembled), stop, bar, started)  # fmt: skip
        stages = (reader, assembler, writing)
        for stage in stages:
            stage.start()
        (_embed_packed if engine.window else _embed_batches)(engine, planned, finished, stop)
        _put(finished, _END, stop)
        assembler.join()
        writing.join()
        if (error := assembler.error or writing.error) is not None:
            raise error
        replace_synced(partial, output_path)
    except BaseException as err:
        stop.set()  # every queue operation and stage loop checks it: the other threads end within POLL_S
        failure = _wound_down(stages, process, partial)
        if isinstance(err, Stopped) and failure is not None:  # a Stopped: another stage failed first
            raise failure from None
        raise
    finally:
        bar.close()
        if process is not None:
            process.close()
    sentences, tokens_total = writing.result
    seconds = time.perf_counter() - started
    return {"sentences": sentences, "tokens": tokens_total, "seconds": seconds, "tokens_per_s": tokens_total / seconds}


def _wound_down(stages: tuple[_Stage, ...], process, partial: Path) -> BaseException | None:
    """After a failure, once `stop` is set: every stage joined and the writer process ended before the partial
    file is removed; returns the first stage's error, if one failed."""
    for stage in stages:
        if stage.is_alive() or stage.ident is not None:
            stage.join()  # the writer closes the file before it is removed
    if process is not None:
        process.close()  # ended before its file is removed
    partial.unlink(missing_ok=True)
    return next((stage.error for stage in stages if stage.error is not None), None)


def _assembler_and_writer(engine, partial: Path, output: Output, dtype: np.dtype, early, process, queues: tuple,
                          stop: threading.Event, bar, started: float) -> tuple[_Stage, _Stage]:  # fmt: skip
    """`embed_file`'s two stages after the engine, for its output: the assembler, from the engine's `finished`
    queue to `assembled` (into the writer process's shared memory where there is one), and the writer (parquet,
    or hdf5 from this process or through the writer process)."""
    finished, assembled = queues
    if process is None:
        assembler = _Stage(stop, _assemble, finished, assembled, stop, early)
    else:
        assembler = _Stage(stop, _assemble_into, finished, assembled, stop, process, output, early, dtype)
    if output.format == "parquet":
        shape = (engine.num_layers, engine.dim)
        return assembler, _Stage(stop, _write_parquet, partial, assembled, stop, bar, started, output, dtype, shape)
    return assembler, _Stage(stop, _write_behind, partial, assembled, stop, bar, started, output, dtype, process)


def refuse_output(path: Path) -> None:
    """Refuse, before any work, an output path that cannot be replaced by a file: a folder, or one in no folder."""
    if path.is_dir():
        raise InputError(f"{path}: a folder; give the output file's path")
    if not path.parent.is_dir():
        raise FileNotFoundError(f"{path.parent}: no such folder for the output")


def partial_name(path: Path) -> Path:
    """A fresh, unpredictable name beside `path` for it to be written under (created exclusively by its writer:
    a name planted in a shared folder cannot redirect the write), naming the host and process that write it."""
    return path.with_name(f"{path.name}.{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(8)}.partial")


def sweep_partials(path: Path) -> list[Path]:
    """Remove what runs killed before they could clean up left beside `path`: its partial files written by a
    process of this host that is gone (another host's, or a live process's, are left alone). Returns them."""
    host, gone = socket.gethostname(), []
    for partial in path.parent.glob(f"{glob.escape(path.name)}.*.partial"):
        writer, _, _ = partial.name[len(path.name) + 1 :].rpartition("-")
        name, _, pid = writer.rpartition("-")
        if name == host and pid.isdecimal() and not _alive(int(pid)) and not partial.is_symlink():
            partial.unlink(missing_ok=True)
            gone.append(partial)
    return gone


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    return True


def replace_synced(partial: Path, path: Path) -> None:
    """`partial`'s bytes on disk, then renamed over `path`, the rename on disk too: a crash leaves the old file
    or the new one, never a file of the right name that is not whole."""
    fd = os.open(partial, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(partial, path)
    folder = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(folder)
    finally:
        os.close(folder)


def _assembled_dtype(output: Output, dtype: str) -> np.dtype:
    """The dtype the assembler gives the writer: --average's layers stay float32 until the writer has averaged them
    (as allennlp), so that a float16 dataset is rounded once; all layers or the top one are rounded by the
    assembler, off the one writing thread."""
    if dtype not in ("float32", "float16"):
        raise ValueError(f"dtype {dtype!r}: float32 or float16")
    return np.dtype(np.float32) if output.layers == "average" else np.dtype(dtype)


def _writer_process_chosen(writer: str) -> bool:
    """Whether `writer` (auto, process or thread) means the writer process here."""
    if writer not in ("auto", "process", "thread"):
        raise ValueError(f"writer {writer!r}: auto, process or thread")
    if writer == "auto":
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        return cores >= WRITER_PROCESS_CORES
    return writer == "process"


def _embed_batches(engine: Engine, planned: queue.Queue, finished: queue.Queue, stop: threading.Event) -> None:
    """The Loop graph: each planned batch in one call (it computes only the sentences' own positions)."""
    while (planned_chunk := _get(planned, stop)) is not _END:
        chunk, batches = planned_chunk
        for batch in batches:
            layers = engine.run([chunk[i][1] for i in batch])
            _put(finished, ([chunk[i] for i in batch], layers), stop)
        _put(finished, chunk, stop)  # the chunk is all embedded: index it and move the progress bar


def _embed_packed(engine: Engine, planned: queue.Queue, finished: queue.Queue, stop: threading.Event) -> None:
    """The window graph: every chunk's sentences through one set of packed rows (service/engine/packing.py), as
    the service runs them, so rows are refilled across chunks and only the file's end is padding. A chunk goes to
    the writer once all its sentences have (chunks in order: a repeated sentence keeps its last line)."""
    packed = PackedRows(engine, prefetch=True)  # the next call's feeds built while this one runs
    enough = 3 * engine.max_rows  # more waiting than a call can start: no row goes empty while lines remain
    chunks: deque[list] = deque()  # chunks admitted, oldest first, each with its count of sentences unfinished
    reading = True
    while True:
        while reading and len(packed.waiting) < enough:
            if (planned_chunk := _get(planned, stop)) is _END:
                reading = False
                break
            chunk = planned_chunk[0]
            left = [len(chunk)]
            chunks.append([chunk, left])
            packed.admit((line[1] for line in chunk), ((line, left) for line in chunk))
        if not packed.busy:
            break
        done = packed.step()
        if done:
            _put(finished, ([s.tag[0] for s in done], done), stop)  # the writer puts each together (`result`)
        for s in done:
            s.tag[1][0] -= 1
        while chunks and chunks[0][1][0] == 0:
            _put(finished, chunks.popleft()[0], stop)


# Bounds on what waits between the stages, so that memory stays bounded however long the input is. A chunk waiting
# to be embedded is only its text and tokens; a batch waiting to be written holds its layers (with the full-size
# model, 12 KB per token: up to 0.8 GB per batch of 65536 tokens on CUDA), hence two.
READ_AHEAD_CHUNKS = 1  # and one more being read: a chunk is CHUNK_BATCHES batches of engine work, ample slack
WRITE_BEHIND_BATCHES = 2
POLL_S = 0.1  # how often a stage blocked on a queue looks whether another one has failed


_END = object()  # the end of a queue's items


class _Stage(threading.Thread):
    """A pipeline stage: `target(*args)`'s return value, or the exception that ended it (but Stopped), which
    also sets `stop` so that the other stages end: the engine thread then raises this exception."""

    def __init__(self, stop: threading.Event, target, *args):
        # daemon: a stage still running (after a second Ctrl-C during the joins) does not keep the process alive
        super().__init__(name=f"elmo-embed {target.__name__.lstrip('_')}", daemon=True)
        self._stop_all, self._call = stop, (target, args)
        self.result = None
        self.error: BaseException | None = None

    def run(self) -> None:
        target, args = self._call
        try:
            self.result = target(*args)
        except Stopped:
            pass
        except BaseException as err:
            self.error = err
            self._stop_all.set()


def _put(q: queue.Queue, item, stop: threading.Event) -> None:
    while not stop.is_set():
        try:
            q.put(item, timeout=POLL_S)
            return
        except queue.Full:
            pass
    raise Stopped


def _get(q: queue.Queue, stop: threading.Event):
    while not stop.is_set():
        try:
            return q.get(timeout=POLL_S)
        except queue.Empty:
            pass
    raise Stopped


def _read_ahead(spans: list[Span], shard: Shard, batch_tokens: int, planned: queue.Queue, stop: threading.Event,
                on_bad: BadLine | None) -> None:  # fmt: skip
    """Reader stage: each chunk of the shard's lines and its batches, in input order, then _END."""
    with contextlib.closing(read_sentences(spans, shard, on_bad)) as lines:
        for chunk in _chunks(_until(stop, lines), CHUNK_BATCHES * batch_tokens):
            _put(planned, (chunk, plan_batches((len(line[1]) for line in chunk), batch_tokens)), stop)
    _put(planned, _END, stop)


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


def _until(stop: threading.Event, lines: Iterator) -> Iterator:
    """The lines, until another stage fails: a chunk on the GPU is two million tokens, too long to finish."""
    for line in lines:
        if stop.is_set():
            raise Stopped
        yield line


def _assemble(finished: queue.Queue, assembled: queue.Queue, stop: threading.Event, dtype: np.dtype) -> None:
    """Assembler stage: each finished batch's layers as contiguous arrays of `dtype` (a packed sentence's put
    together from its pieces, rounded as it is written there); chunks and the end pass through in order."""
    while (item := _get(finished, stop)) is not _END:
        if not isinstance(item, list):  # a batch: (line indexes, layers)
            lines, layers = item
            item = (lines, [np.ascontiguousarray(x, dtype) if isinstance(x, np.ndarray) else x.result(dtype)
                            for x in layers])  # fmt: skip
        _put(assembled, item, stop)
    _put(assembled, _END, stop)


def _write_behind(
    partial: Path,
    finished: queue.Queue,
    stop: threading.Event,
    bar: tqdm,
    started: float,
    output: Output,
    dtype: np.dtype,
    process: WriterProcess | None = None,
):
    """Writer stage: one dataset per line of each finished batch, then, at _END, sentence_to_index. Returns the
    sentences and tokens written. With sentence keys, each dataset is written under its line index in a group
    no sentence can name (a line holds no newline) and moved to its sentence at the end (a link's move, no
    copy): a batch's text reaches this stage only after its layers. With a writer `process`, the datasets went to
    it from the assembler: this stage counts the chunks, and hands it sentence_to_index at the end."""
    tally = _Tally(output, bar, started)
    with contextlib.nullcontext() if process is not None else create_file(partial) as out:
        write = dataset_writer(out) if out is not None else None
        if output.sentence_keys and out is not None:
            out.create_group(PENDING)
        while (item := _get(finished, stop)) is not _END:
            if isinstance(item, list):  # a chunk, all of whose batches came before it
                tally.add(item)
                continue
            for (line_index, *_), layers in zip(*item, strict=True):
                if stop.is_set():  # another stage failed: this file is about to be removed
                    raise Stopped
                name = f"{PENDING}/{line_index}" if output.sentence_keys else str(line_index)
                write(name, np.ascontiguousarray(output.select(layers), dtype))
        bar.update(bar.total - bar.n)  # the other shards' lines after this shard's last one
        if process is not None:
            process.finish(tally.sentence_to_index)
        else:
            finish_file(out, output, tally.sentence_to_index)
    return tally.sentences, tally.tokens


def _write_parquet(partial: Path, finished: queue.Queue, stop: threading.Event, bar: tqdm, started: float,
                   output: Output, dtype: np.dtype, shape: tuple[int, int]):  # fmt: skip
    """Writer stage of --format parquet: a row per line (service/bulk/parquet.py), in the order the lines finish
    (their `line` column says where each was). Returns the sentences and tokens written."""
    from service.bulk.parquet import PartWriter  # pyarrow: the `ray` extra's, loaded only for Parquet

    tally = _Tally(output, bar, started)
    with PartWriter(partial, output, dtype, shape) as part:
        while (item := _get(finished, stop)) is not _END:
            if isinstance(item, list):
                tally.add(item)
                continue
            for (line_index, tokens, text, _), layers in zip(*item, strict=True):
                if stop.is_set():
                    raise Stopped
                part.add(line_index, tokens, text, np.ascontiguousarray(output.select(layers), dtype))
    bar.update(bar.total - bar.n)
    return tally.sentences, tally.tokens


class _Tally:
    """The writer's count of a finished chunk's lines: sentences, tokens, sentence_to_index, the progress bar."""

    def __init__(self, output: Output, bar: tqdm, started: float):
        self.output, self.bar, self.started = output, bar, started
        self.sentence_to_index: dict[str, str] = {}
        self.sentences = self.tokens = 0

    def add(self, chunk: list) -> None:
        for line_index, tokens, text, read in chunk:
            if self.output.sentence_keys and text in self.sentence_to_index:  # allennlp's words
                raise InputError(f"line {line_index}: key already exists: to encode duplicate sentences, "
                                 "do not pass --use-sentence-keys")  # fmt: skip
            self.sentence_to_index[text] = str(line_index)  # in line order: a repeated sentence keeps its last
            self.sentences += 1
            self.tokens += len(tokens)
            self.bar.update(read)
        self.bar.set_postfix(tokens_per_s=f"{self.tokens / (time.perf_counter() - self.started):.0f}")


def _assemble_into(finished: queue.Queue, assembled: queue.Queue, stop: threading.Event, process: WriterProcess,
                   output: Output, early: np.dtype, dtype: np.dtype) -> None:  # fmt: skip
    """Assembler stage with a writer process: each finished sentence's dataset put together straight into a block of
    the shared ring (its one copy), the block's table sent to the process once the next sentence does not fit, in
    the order the thread writer writes them; chunks and the end pass through to the writer stage."""
    block, table, used = None, [], 0

    def send() -> None:
        nonlocal block, table, used
        if block is not None:
            process.write_block(block, table)
        block, table, used = None, [], 0

    while (item := _get(finished, stop)) is not _END:
        if isinstance(item, list):  # a chunk
            _put(assembled, item, stop)
            continue
        for (line_index, *_), x in zip(*item, strict=True):
            if stop.is_set():
                raise Stopped
            name = f"{PENDING}/{line_index}" if output.sentence_keys else str(line_index)
            whole = output.layers == "all" and not isinstance(x, np.ndarray)  # put together where it is written
            layers = None if whole else output.select(np.asarray(x, early) if isinstance(x, np.ndarray) else
                                                      x.result(early))  # fmt: skip
            shape = _shape(x) if whole else layers.shape
            size = math.prod(shape) * dtype.itemsize
            if size > process.block_bytes:  # larger than a block: by the pipe, in its turn
                send()
                process.write_array(name, np.ascontiguousarray(layers if layers is not None else x.result(dtype),
                                                               dtype))  # fmt: skip
                continue
            if block is None or used + size > process.block_bytes:
                send()
                block = process.take(stop)
            view = process.blocks[block][used : used + size].view(dtype).reshape(shape)
            if layers is None:
                x.result(dtype, out=view)
            else:
                np.copyto(view, layers)  # rounded to `dtype` here, as np.ascontiguousarray(layers, dtype) rounds
            table.append((name, shape, dtype.str, used))
            used += size
    send()
    _put(assembled, _END, stop)


def _shape(sentence) -> tuple[int, ...]:
    """The (num_layers, n_tokens, dim) of a packed sentence's result."""
    lstm = sentence.pieces[0][3]
    return (lstm.shape[0] + 1, sentence.length - 2, 2 * lstm.shape[-1])


# The cores from which "auto" writes from a process: the engine's thread, the reader, the assembler, and a core for
# the writer (measured on 2 shared cores: 0.6-0.9 s of the pipeline's CPU moved out, 1.2-1.4 s spent in the process)
WRITER_PROCESS_CORES = 4


def read_embeddings(path: str | Path) -> tuple[dict[int, np.ndarray], dict[str, str]]:
    """All of an elmo-embed output file: line index -> layers, in line order, and sentence_to_index (for tests
    and small files). A shard's file holds only its own lines."""
    with h5py.File(path, "r") as f:
        index = json.loads(f["sentence_to_index"][0])
        lines = sorted(int(name) for name in f if name != "sentence_to_index")
        return {line: f[str(line)][...] for line in lines}, index
