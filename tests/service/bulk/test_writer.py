"""elmo-embed's writer process (service/bulk.py `_WriterProcess`): the hdf5 file written by a process of its own,
fed through a ring of shared-memory blocks, equals the thread writer's file dataset by dataset (names, shapes,
dtypes, values, sentence_to_index) and byte for byte, with every output flag and both graphs; an error in the
process fails elmo-embed with that error, and a process that dies is named, without a hang or a file left."""

from __future__ import annotations

import sys
import threading
import time

import h5py
import numpy as np
import pytest

import service.bulk.pipeline
from service.bulk import Output, WriterError, embed_file


@pytest.fixture(scope="module")
def window_engine(tiny_model_dir):
    from service.engine.session import Engine

    return Engine(tiny_model_dir, provider="cpu", graph="window", max_rows=16)


def datasets(path) -> dict[str, tuple]:
    """Every dataset of the file by its path: (dtype, shape, values)."""
    found = {}
    with h5py.File(path, "r") as f:
        f.visititems(lambda name, obj: found.__setitem__(name, (obj.dtype, obj.shape, obj[...]))
                     if isinstance(obj, h5py.Dataset) else None)  # fmt: skip
    return found


@pytest.mark.parametrize(
    ("graph", "output", "dtype", "block_bytes"),
    [
        ("loop", Output(), "float32", None),
        ("loop", Output(layers="top"), "float16", None),
        ("loop", Output(layers="average"), "float16", None),
        ("loop", Output(sentence_keys=True), "float32", None),
        ("loop", Output(forget_sentences=True), "float32", None),
        ("window", Output(), "float32", None),
        ("window", Output(), "float16", None),
        ("window", Output(layers="average"), "float32", None),
        ("window", Output(), "float32", 4096),  # most sentences larger than a block: through the pipe, in turn
    ],
)
def test_the_writer_process_writes_the_thread_writers_file(engine, window_engine, sentences, tmp_path, monkeypatch,
                                                           graph, output, dtype, block_bytes):  # fmt: skip
    monkeypatch.setattr("service.bulk.pipeline.CHUNK_BATCHES", 1)  # many chunks and batches
    if block_bytes:
        monkeypatch.setattr("service.bulk.pipeline.BLOCK_BYTES", block_bytes)  # the forked process sees it too
    source = tmp_path / "in.txt"
    lines = sentences * 3 if not output.sentence_keys else sentences  # sentence keys refuse a repeated line
    source.write_text("".join(" ".join(s) + "\n" for s in lines))
    chosen = engine if graph == "loop" else window_engine
    files = {}
    for writer in ("thread", "process"):
        files[writer] = tmp_path / f"{writer}.hdf5"
        stats = embed_file(chosen, source, files[writer], batch_tokens=200, progress=False, output=output,
                           dtype=dtype, writer=writer)  # fmt: skip
        assert stats["sentences"] == len(lines)
    want, got = datasets(files["thread"]), datasets(files["process"])
    assert list(got) == list(want) and len(want) >= len(lines)  # the same names, in the same order
    for name, (kind, shape, values) in want.items():
        assert got[name][:2] == (kind, shape), name
        np.testing.assert_array_equal(got[name][2], values, err_msg=name)
    assert ("sentence_to_index" in want) == (not output.sentence_keys and not output.forget_sentences)
    # and byte for byte (the datasets carry no modification times, as h5py's create_dataset writes them)
    assert files["thread"].read_bytes() == files["process"].read_bytes()


class FailingWrites:
    """_dataset_writer replaced (the forked writer process inherits it): the `at`-th dataset raises `error`, or, for
    `exit`, the process ends at once with that code, as a crash would."""

    def __init__(self, at: int, error: BaseException | None = None, exit: int | None = None):
        self.at, self.error, self.exit = at, error, exit
        self.real = service.bulk.pipeline._dataset_writer

    def __call__(self, out):
        write, count = self.real(out), [0]

        def failing(name, array):
            count[0] += 1
            if count[0] == self.at:
                if self.exit is not None:
                    import os

                    os._exit(self.exit)
                raise self.error
            write(name, array)

        return failing


@pytest.mark.parametrize("graph", ["loop", "window"])
def test_an_error_in_the_writer_process_fails_elmo_embed_with_it(engine, window_engine, sentences, tmp_path,
                                                                 monkeypatch, graph):  # fmt: skip
    monkeypatch.setattr("service.bulk.pipeline.CHUNK_BATCHES", 1)
    full = OSError(28, "No space left on device")
    monkeypatch.setattr("service.bulk.pipeline._dataset_writer", FailingWrites(50, full))
    source = tmp_path / "in.txt"
    source.write_text("".join(" ".join(s) + "\n" for s in sentences * 10))
    threads, start = threading.active_count(), time.perf_counter()
    with pytest.raises(OSError, match="No space left on device") as raised:
        embed_file(engine if graph == "loop" else window_engine, source, tmp_path / "out.hdf5", batch_tokens=200,
                   progress=False, writer="process")  # fmt: skip
    if sys.version_info >= (3, 11):  # notes from 3.11 on: the process's traceback
        assert "raised in the hdf5 writer process" in raised.value.__notes__[0]
        assert "in failing" in raised.value.__notes__[0]  # the function that raised, in the process
    assert time.perf_counter() - start < 20  # no hang
    assert not list(tmp_path.glob("out.hdf5*")) and threading.active_count() == threads


def test_a_writer_process_that_dies_is_named(engine, sentences, tmp_path, monkeypatch):
    monkeypatch.setattr("service.bulk.pipeline.CHUNK_BATCHES", 1)
    monkeypatch.setattr("service.bulk.pipeline._dataset_writer", FailingWrites(20, exit=7))
    source = tmp_path / "in.txt"
    source.write_text("".join(" ".join(s) + "\n" for s in sentences * 10))
    threads, start = threading.active_count(), time.perf_counter()
    with pytest.raises(WriterError, match="exit code 7"):
        embed_file(engine, source, tmp_path / "out.hdf5", batch_tokens=200, progress=False, writer="process")
    assert time.perf_counter() - start < 20
    assert not list(tmp_path.glob("out.hdf5*")) and threading.active_count() == threads


def test_a_folder_that_does_not_exist_is_the_writer_process_error(engine, sentences, tmp_path):
    source = tmp_path / "in.txt"
    source.write_text("".join(" ".join(s) + "\n" for s in sentences))
    with pytest.raises(OSError):
        embed_file(engine, source, tmp_path / "no such folder" / "out.hdf5", progress=False, writer="process")


def test_the_writer_on_the_command_line(tiny_model_dir, sentences, tmp_path):
    from tests.service.bulk.test_pipeline import embed_cli

    source = tmp_path / "in.txt"
    source.write_text("".join(" ".join(s) + "\n" for s in sentences))
    for writer in ("process", "thread"):
        run = embed_cli(tiny_model_dir, source, tmp_path / f"{writer}.hdf5", "--writer", writer, "--no-progress")
        assert run.returncode == 0, run.stderr
    assert (tmp_path / "process.hdf5").read_bytes() == (tmp_path / "thread.hdf5").read_bytes()
    refused = embed_cli(tiny_model_dir, source, tmp_path / "x.hdf5", "--writer", "threads")
    assert refused.returncode != 0 and "--writer" in refused.stderr


def test_a_writer_process_whose_parent_is_gone_ends(tmp_path):
    # a parent that is killed closes nothing itself: the kernel closes its ends of the pipes. The process held the
    # commands' sending end too (inherited at the fork) and so waited for a command for ever (a review found it);
    # here the parent's ends are closed as a kill would close them
    writer = service.bulk.pipeline._WriterProcess(tmp_path / "out.hdf5.partial", Output(), threading.Event())
    try:
        assert writer.process.is_alive()
        writer._commands.close()
        writer._replies.close()
        writer.process.join(10)
        assert not writer.process.is_alive()
    finally:
        writer.close()
