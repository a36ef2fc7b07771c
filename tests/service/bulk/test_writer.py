"""elmo-embed's writer process (service/bulk/hdf5_writer.py): the hdf5 file written by a process of its own,
fed through a ring of shared-memory blocks, equals the thread writer's file dataset by dataset (names, shapes,
dtypes, values, sentence_to_index) and byte for byte, with every output flag and both graphs; an error in the
process fails elmo-embed with that error, and a process that dies is named, without a hang or a file left; the
process is a fresh interpreter, which no lock or at-fork hook of its parent can hang."""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
import threading
import time

import h5py
import numpy as np
import pytest
from tqdm._monitor import TMonitor

from service.bulk import Output, WriterError, embed_file, hdf5_writer, read_embeddings


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
        monkeypatch.setattr(hdf5_writer, "BLOCK_BYTES", block_bytes)  # the writer process is told it
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


def own_threads() -> int:
    """The threads of this process but tqdm's monitor, which its first bar starts (even a disabled one) and which
    lives on: a test run alone would count it as left behind."""
    return sum(not isinstance(t, TMonitor) for t in threading.enumerate())


class WriterStarts:
    """hdf5_writer's Popen wrapped: `then(process)` done to each writer process at once, as it starts (the real
    process: a limit set on it, or a kill)."""

    def __init__(self, then):
        self.then, self.real, self.started = then, hdf5_writer.Popen, []

    def __call__(self, *args, **kwargs):
        process = self.real(*args, **kwargs)
        self.started.append(process)
        self.then(process)
        return process


@pytest.mark.parametrize("graph", ["loop", "window"])
def test_an_error_in_the_writer_process_fails_elmo_embed_with_it(engine, window_engine, sentences, tmp_path,
                                                                 monkeypatch, graph):  # fmt: skip
    # a real write error in the process: a file size limit on it alone (Python ignores SIGXFSZ, so the write
    # that would pass the limit fails with EFBIG, as a full disk's fails with ENOSPC)
    monkeypatch.setattr("service.bulk.pipeline.CHUNK_BATCHES", 1)
    limit = 128 << 10
    starts = WriterStarts(lambda process: resource.prlimit(process.pid, resource.RLIMIT_FSIZE, (limit, limit)))
    monkeypatch.setattr(hdf5_writer, "Popen", starts)
    source = tmp_path / "in.txt"
    source.write_text("".join(" ".join(s) + "\n" for s in sentences * 10))
    threads, start = own_threads(), time.perf_counter()
    with pytest.raises((OSError, RuntimeError), match=r"(?i)file too large") as raised:  # as h5py words it
        embed_file(engine if graph == "loop" else window_engine, source, tmp_path / "out.hdf5", batch_tokens=200,
                   progress=False, writer="process")  # fmt: skip
    assert len(starts.started) == 1 and starts.started[0].returncode is not None  # it said why, and is gone
    if sys.version_info >= (3, 11):  # notes from 3.11 on: the process's traceback
        assert "raised in the hdf5 writer process" in raised.value.__notes__[0]
        assert "in serve" in raised.value.__notes__[0]  # the process's own traceback
    assert time.perf_counter() - start < 20  # no hang
    assert not list(tmp_path.glob("out.hdf5*")) and own_threads() == threads


@pytest.mark.parametrize("written", [0, 256 << 10])
def test_a_writer_process_that_dies_is_named(engine, sentences, tmp_path, monkeypatch, written):
    # killed (as the kernel's out-of-memory killer kills) as it starts, or once it has written part of the file
    monkeypatch.setattr("service.bulk.pipeline.CHUNK_BATCHES", 1)
    watchers = []

    def kill_once_writing(process) -> None:
        def watch() -> None:
            while process.poll() is None:
                if sum(p.stat().st_size for p in tmp_path.glob("out.hdf5*")) >= written:
                    os.kill(process.pid, signal.SIGKILL)
                    return
                time.sleep(0.002)

        watchers.append(threading.Thread(target=watch))
        watchers[-1].start()

    monkeypatch.setattr(hdf5_writer, "Popen", WriterStarts(kill_once_writing))
    source = tmp_path / "in.txt"
    source.write_text("".join(" ".join(s) + "\n" for s in sentences * 10))
    threads, start = own_threads(), time.perf_counter()
    with pytest.raises(WriterError, match="killed by SIGKILL"):
        embed_file(engine, source, tmp_path / "out.hdf5", batch_tokens=200, progress=False, writer="process")
    assert time.perf_counter() - start < 20
    for watcher in watchers:
        watcher.join()
    assert not list(tmp_path.glob("out.hdf5*")) and own_threads() == threads


# A process that, at the writer process's start, holds what a fork would have copied locked, or runs: a thread
# holding h5py's lock, and an at-fork hook that never returns (as an OpenTelemetry provider's hook hung a forked
# writer). A fork of it could never write; a fresh interpreter does not inherit them.
HOSTILE = """
import os, sys, threading, time
import h5py
from service.bulk import embed_file
from service.engine.session import Engine

engine = Engine(sys.argv[1], provider="cpu")
os.register_at_fork(after_in_child=lambda: time.sleep(3600))
held, release = threading.Event(), threading.Event()

def hold():
    with h5py._objects.phil:
        held.set()
        release.wait()

threading.Thread(target=hold, daemon=True).start()
held.wait()
threading.Timer(3, release.set).start()  # the lock held while the process starts and runs
print(embed_file(engine, sys.argv[2], sys.argv[3], batch_tokens=200, progress=False, writer="process")["sentences"])
"""


def test_the_writer_process_inherits_no_lock_or_fork_hook_of_its_parent(tiny_model_dir, sentences, tmp_path):
    source = tmp_path / "in.txt"
    source.write_text("".join(" ".join(s) + "\n" for s in sentences))
    run = subprocess.run([sys.executable, "-c", HOSTILE, str(tiny_model_dir), str(source), str(tmp_path / "o.hdf5")],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == [str(len(sentences))]
    assert len(read_embeddings(tmp_path / "o.hdf5")[0]) == len(sentences)


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
    # a parent that is killed closes nothing itself: the kernel closes its ends of the pipes (here closed as a
    # kill would close them); the process holds none of them (a forked one once held the commands' sending end,
    # and waited for a command for ever)
    writer = hdf5_writer.WriterProcess(tmp_path / "out.hdf5.partial", Output(), threading.Event())
    try:
        assert writer.process.poll() is None
        writer._commands.close()
        writer._replies.close()
        assert writer.process.wait(10) == 0
    finally:
        writer.close()


@pytest.mark.parametrize("writer", ["thread", "process"])
def test_a_full_disk_ends_elmo_embed_with_the_write_s_error_not_a_crash(tiny_model_dir, sentences, tmp_path, writer):
    # elmo-embed under a file size limit (Python ignores SIGXFSZ: the write past it fails with EFBIG, as a full
    # disk's with ENOSPC). With HDF5's sieve buffer, the data was written as each dataset closed, in h5py's
    # deallocation, which ignored the error; the file's close then crashed the process (SIGSEGV)
    source = tmp_path / "in.txt"
    source.write_text("".join(" ".join(s) + "\n" for s in sentences * 10))
    limit = 256 << 10
    command = [sys.executable, "-m", "service.cli", "--model", tiny_model_dir, source, tmp_path / "o.hdf5",
               "--writer", writer, "--no-progress"]  # fmt: skip
    run = subprocess.run(command, capture_output=True, text=True, timeout=120,
                         preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit)))  # fmt: skip
    assert run.returncode == 1, run.stderr[-2000:]
    assert "file too large" in run.stderr.lower(), run.stderr[-2000:]
    assert not list(tmp_path.glob("o.hdf5*"))
