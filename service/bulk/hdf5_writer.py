"""The hdf5 output's writing: the file (`create_file`), a dataset per line through h5py's low-level calls
(`dataset_writer`), what follows the datasets (`finish_file`), and the writer process that does all three
outside the pipeline's interpreter (`WriterProcess`).

The writer process is a fresh interpreter (`python -c ... serve()`), never a fork of the pipeline's. A fork copies
one thread of a process that runs many (ONNX Runtime's, a server's, an exporter's, Ray's): whatever lock another
thread held at that moment stays held in the child for ever, and every at-fork hook a library registered runs in
it (an OpenTelemetry provider's started a thread there that never ran, and hung the test suite twice). A fresh
interpreter inherits only what it is handed: the ring's memory and the two pipes, by file descriptor.
"""

from __future__ import annotations

import contextlib
import json
import math
import mmap
import os
import signal
import sys
import tempfile
import threading
import traceback
from multiprocessing.connection import Connection, Pipe
from pathlib import Path
from subprocess import DEVNULL, Popen, TimeoutExpired

import h5py
import numpy as np

PENDING = "\n"  # the group of the datasets not yet named by their sentence (--use-sentence-keys)
# The ring between the assembler and the writer process: blocks of shared memory, reused; a sentence larger than a
# block goes through the pipe. 8 x 4 MB: the writer may be a few blocks behind; 32 MB touched once a run
# (first-touch pages are slow on a loaded VM).
BLOCK_BYTES = 4 << 20
RING_BLOCKS = 8
# The process's program: this very package (the folder it is imported from, first on the path: the working
# folder, which `python -c` would put first, may hold another `service`), serving the descriptors it is given
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])
_SERVE = "import sys; sys.path.insert(0, sys.argv[1]); from service.bulk.hdf5_writer import serve; serve()"
EXIT_S = 30.0  # how long a process that has closed the file may take to exit before it is killed
POLL_S = 0.1  # how often a wait for the process looks whether the pipeline has stopped, or the process ended


def create_file(path: str | Path) -> h5py.File:
    """A new hdf5 file at `path` (created exclusively), as h5py.File(path, "x") makes it, byte for byte, but for one
    setting: no sieve buffer. With it, a dataset's data is written when the dataset is closed, in h5py's
    deallocation, which ignores the error of a full disk and leaves HDF5 to crash as the file closes (h5py issue
    914: measured here, a segmentation fault three times in four, whatever the limit). Without it, each dataset is
    written by its own write call (one system call either way: a dataset is written whole), which raises the
    error: the run ends with "File too large" or "No space left on device"."""
    fapl = h5py.h5p.create(h5py.h5p.FILE_ACCESS)
    fapl.set_libver_bounds(h5py.h5f.LIBVER_EARLIEST, h5py.h5f.LIBVER_LATEST)  # h5py's default
    fapl.set_sieve_buf_size(0)
    fcpl = h5py.h5p.create(h5py.h5p.FILE_CREATE)
    fcpl.set_obj_track_times(False)  # h5py's default: the same input makes the same file
    return h5py.File(h5py.h5f.create(os.fsencode(path), h5py.h5f.ACC_EXCL, fapl=fapl, fcpl=fcpl))


def dataset_writer(out: h5py.File):
    """write(name, array): one float32 (or float16) dataset, through h5py's low-level calls (the high-level
    create_dataset spends several times longer per dataset in Python, and a file holds one dataset per line)."""
    spaces: dict[tuple, h5py.h5s.SpaceID] = {}
    # no modification times in the object headers, as h5py's create_dataset (allennlp's) writes them: the same
    # input gives the same file, byte for byte
    plist = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
    plist.set_obj_track_times(False)

    def write(name: str, array: np.ndarray) -> None:  # a contiguous float32 or float16 array
        space = spaces.get(array.shape) or spaces.setdefault(array.shape, h5py.h5s.create_simple(array.shape))
        kind = h5py.h5t.IEEE_F16LE if array.dtype == np.float16 else h5py.h5t.IEEE_F32LE
        dataset = h5py.h5d.create(out.id, name.encode(), kind, space, dcpl=plist)
        dataset.write(h5py.h5s.ALL, h5py.h5s.ALL, array)

    return write


def finish_file(out: h5py.File, output, sentence_to_index: dict[str, str]) -> None:
    """What follows the datasets: their moves to their sentences' names, or sentence_to_index; what made the file.
    `output`: the run's service.bulk.pipeline.Output."""
    if output.about:
        out.attrs["elmo_embed"] = output.about
    if output.sentence_keys:
        for text, line_index in sentence_to_index.items():
            out.move(f"{PENDING}/{line_index}", text)  # a "/" in it makes groups, as allennlp's create_dataset
        del out[PENDING]
    elif not output.forget_sentences:
        index = out.create_dataset("sentence_to_index", (1,), dtype=h5py.string_dtype())
        index[0] = json.dumps(sentence_to_index)


class WriterError(RuntimeError):
    """The hdf5 writer process ended without saying why."""


class Stopped(Exception):
    """The pipeline stopped (another stage failed) while this side waited for the process."""


class WriterProcess:
    """The output file written by a process of its own: h5py's ~65 us per dataset (one per sentence, the allennlp
    layout) no longer shares an interpreter lock with the pipeline. Fed through a ring of shared-memory blocks
    (a memfd, handed to the process by descriptor: nothing named to clean up): the assembler writes each dataset
    into a free block (`take`), sends the block's table (name, shape, dtype, offset) down a pipe (`write_block`),
    and the process creates the datasets in that order from the block, then hands the block back. An error in the
    process (a full disk, say) comes back as the exception it raised, with its traceback in a note, to whichever
    side waits next; a process that dies without a word is named; `stop` ends every wait. If this process dies,
    the commands' pipe ends, and so does the writer."""

    def __init__(self, partial: Path, output, stop: threading.Event):
        self.stop = stop
        self.block_bytes = BLOCK_BYTES
        size = RING_BLOCKS * self.block_bytes
        self._ring_file = _shared_file(size)
        self.ring = mmap.mmap(self._ring_file.fileno(), size)
        self.blocks = [np.frombuffer(self.ring, np.uint8, self.block_bytes, i * self.block_bytes)
                       for i in range(RING_BLOCKS)]  # fmt: skip
        self.free = list(range(RING_BLOCKS))
        commands_in, self._commands = Pipe(duplex=False)
        self._replies, replies_out = Pipe(duplex=False)
        handed = (self._ring_file.fileno(), commands_in.fileno(), replies_out.fileno())
        # only the descriptors handed over cross (close_fds): the process holds no end of this side's pipes, so it
        # sees an end of file when this process goes, however it goes
        self.process = Popen([sys.executable, "-c", _SERVE, _PACKAGE_ROOT, *map(str, handed)], pass_fds=handed,
                             stdin=DEVNULL)  # fmt: skip
        commands_in.close()  # the process's ends: a dead process is then an end of file here, not a wait
        replies_out.close()
        try:
            self._send(("open", str(partial), output, self.block_bytes, RING_BLOCKS))
        except BaseException:  # it died at once: nothing else will close it
            self.close()
            raise

    def take(self, stop: threading.Event) -> int:
        """A free block (the assembler's thread): waits for the process to hand one back."""
        while not self.free:
            self._receive()
        return self.free.pop()

    def write_block(self, block: int, table: list) -> None:
        self._send(("block", block, table))

    def write_array(self, name: str, array: np.ndarray) -> None:
        self._send(("array", name, array))

    def finish(self, sentence_to_index: dict[str, str]) -> None:
        """The datasets' moves or sentence_to_index written, the file closed: returns once the process says so."""
        self._send(("finish", sentence_to_index))
        while self._receive()[0] != "done":
            pass
        try:  # the file is whole and closed: the process only has its own exit left
            self.process.wait(EXIT_S)
        except TimeoutExpired:
            self.process.kill()

    def _send(self, message: tuple) -> None:
        try:
            self._commands.send(message)
        except (BrokenPipeError, ConnectionResetError, EOFError):
            while True:  # the process has ended: its error, if it sent one, or that it died
                self._receive()

    def _receive(self) -> tuple:
        while not self._replies.poll(POLL_S):
            if self.stop.is_set():
                raise Stopped
            if self.process.poll() is not None and not self._replies.poll():
                raise WriterError(self._ended())
        try:
            message = self._replies.recv()
        except EOFError:  # its end of the pipe closed: it has ended, or is ending
            with contextlib.suppress(Exception):
                self.process.wait(POLL_S * 10)
            raise WriterError(self._ended()) from None
        if message[0] == "free":
            self.free.append(message[1])
        elif message[0] == "error":
            _, err, trace = message
            if hasattr(err, "add_note"):  # Python 3.11 on (on 3.10 the process's traceback is not shown)
                err.add_note(f"raised in the hdf5 writer process:\n{trace}")
            raise err
        return message

    def _ended(self) -> str:
        code = self.process.returncode
        if code is not None and code < 0:
            return f"the hdf5 writer process was killed by {signal.Signals(-code).name}"
        return f"the hdf5 writer process ended with exit code {code}"

    def close(self) -> None:
        """End the process (at once, if it has not finished) and let go of the ring."""
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        self._commands.close()
        self._replies.close()
        self.blocks = []
        with contextlib.suppress(BufferError):  # a view still alive somewhere: the mapping goes with it
            self.ring.close()
        self._ring_file.close()


def _shared_file(size: int):
    """An anonymous file of `size` bytes in memory, whose descriptor another process can map: a memfd on Linux, an
    unlinked temporary file elsewhere."""
    if hasattr(os, "memfd_create"):
        ring = open(os.memfd_create("elmo-embed ring"), "r+b", buffering=0)  # noqa: SIM115 (closed by close())
    else:  # pragma: no cover (macOS)
        ring = tempfile.TemporaryFile()  # noqa: SIM115
    os.ftruncate(ring.fileno(), size)
    return ring


def serve() -> None:
    """The writer process (its command line: the package's folder, then the ring's, the commands' and the replies'
    descriptors): the file opened as the first command says, datasets from the ring's blocks in the order given,
    then the end of the file. Its error goes back as the exception itself, with the traceback."""
    ring_fd, commands_fd, replies_fd = map(int, sys.argv[2:5])
    commands = Connection(commands_fd, writable=False)
    replies = Connection(replies_fd, readable=False)
    try:
        _, partial, output, block_bytes, blocks = commands.recv()
        ring = mmap.mmap(ring_fd, block_bytes * blocks)
        os.close(ring_fd)
        with create_file(partial) as out:
            write = dataset_writer(out)
            if output.sentence_keys:
                out.create_group(PENDING)
            while (message := commands.recv())[0] != "finish":
                if message[0] == "array":
                    write(message[1], message[2])
                    continue
                _, block, table = message
                for name, shape, dtype, offset in table:
                    at = block * block_bytes + offset
                    write(name, np.frombuffer(ring, dtype, math.prod(shape), at).reshape(shape))
                replies.send(("free", block))
            finish_file(out, output, message[1])
        replies.send(("done",))
    except BaseException as err:  # every error goes back to the pipeline, which raises it
        trace = traceback.format_exc()
        try:
            replies.send(("error", err, trace))
        except OSError:  # the parent has gone (the pipe is closed): no one to tell
            pass
        except Exception:  # an error that does not pickle
            with contextlib.suppress(OSError):
                replies.send(("error", WriterError(f"{type(err).__name__}: {err}"), trace))
