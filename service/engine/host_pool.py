"""Reused host memory for the window graph's outputs: a call's layers are written into a block lent by the pool,
not into a fresh allocation (first-touch writes of a fresh 400 MB array cost several times the copy itself).

A block is lent again only once nothing holds it: the sentences of a call keep views of its block until their
layers are put together (packing.Sentence.result), and a numpy view holds a reference to the array that owns the
memory, so the owner's reference count says whether any view is alive. The pool never frees a block itself: it
only drops its own reference to free blocks beyond `keep`, and the memory goes when the last view goes (a block of
pinned memory holds the object that frees it, so it too lives as long as a view of it)."""

from __future__ import annotations

import sys
from collections.abc import Callable

import numpy as np


def _idle_references() -> int:
    """What getrefcount says, in `BlockPool.take`'s own comprehension, of an object only a list holds: measured
    with the same code shape rather than written down, since interpreters count a loop variable or a call's
    argument differently (CPython 3.14 borrows some references that earlier versions counted)."""
    held = [np.empty(1, np.float32)]
    return [sys.getrefcount(b) for b in held][0]  # noqa: RUF015 (a list comprehension, as in take)


_IDLE_REFS = _idle_references()


def numpy_allocator(floats: int) -> np.ndarray:
    return np.empty(floats, np.float32)


def cudart():
    """The CUDA runtime library (ctypes), as onnxruntime-gpu loads it (`onnxruntime.preload_dlls`); None where it
    cannot be loaded."""
    import ctypes

    for name in ("libcudart.so.12", "libcudart.so.13", "libcudart.so"):
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    return None


class _PinnedMemory:
    """Page-locked host memory from cudaHostAlloc, freed when the last array over it goes. Allocated with the
    session's device current (cudaSetDevice; the caller's device restored after): pinned memory belongs to the
    context of the device current when it is allocated, and on a multi-GPU host another device's pinned memory is
    pageable to this one's copies (a staged, slower copy)."""

    def __init__(self, library, nbytes: int, device_id: int = 0):
        import ctypes

        self.library, self.pointer = library, ctypes.c_void_p()
        current = ctypes.c_int()
        if library.cudaGetDevice(ctypes.byref(current)):
            raise RuntimeError("cudaGetDevice failed")
        if library.cudaSetDevice(device_id):
            raise RuntimeError(f"cudaSetDevice({device_id}) failed")
        try:
            if library.cudaHostAlloc(ctypes.byref(self.pointer), ctypes.c_size_t(nbytes), 0):
                raise MemoryError(f"cudaHostAlloc of {nbytes} bytes on device {device_id} failed")
        finally:
            library.cudaSetDevice(current.value)

    def __del__(self):
        if self.pointer.value:
            self.library.cudaFreeHost(self.pointer)


def pinned_allocator(device_id: int = 0) -> Callable[[int], np.ndarray]:
    """Blocks of page-locked host memory for the session on `device_id` (copies from the device run at full speed,
    without a staging copy), viewed as numpy arrays that keep the memory alive; pageable numpy memory where the CUDA
    runtime library cannot be loaded. (ONNX Runtime's Python API allocates no pinned host memory for the bundled
    CUDA provider.)"""
    import ctypes

    library = cudart()
    if library is None:
        return numpy_allocator

    def allocate(floats: int) -> np.ndarray:
        owner = _PinnedMemory(library, 4 * floats, device_id)
        memory = (ctypes.c_float * floats).from_address(owner.pointer.value)
        memory._owner = owner  # the ctypes array (the numpy array's base) keeps the pinned memory alive
        return np.frombuffer(memory, np.float32)

    return allocate


def _rounded(floats: int) -> int:
    """`floats` rounded up to a multiple of an eighth of the next power of two (at most 12.5% more)."""
    step = max(1, (1 << max(0, floats - 1).bit_length()) // 8)
    return -(-floats // step) * step


class HostPool:
    """Float32 blocks lent for one call's outputs and taken back implicitly once no view of them is alive.

    `take(floats)` returns a block of at least that many floats (the smallest free one that fits, else a new one,
    its size rounded up to an eighth of a power of two so that calls of similar sizes share blocks). At most `keep`
    free blocks are held: enough that engine.run's and a stream's calls find one free (a sentence spanning calls
    holds each call's block until it is put together), and each one held is memory (330 MB a call of 1,024 rows at
    full size). Not thread-safe: the engine's thread takes; other threads only drop views."""

    def __init__(self, allocate: Callable[[int], np.ndarray] = numpy_allocator, keep: int = 3):
        self.allocate, self.keep = allocate, keep
        self.blocks: list[np.ndarray] = []
        self.allocated = 0  # blocks made, over the pool's life (tests, bench.host)

    def take(self, floats: int) -> np.ndarray:
        free = [b for b in self.blocks if sys.getrefcount(b) <= _IDLE_REFS]
        fitting = [b for b in free if len(b) >= floats]
        if fitting:
            block = min(fitting, key=len)
        else:
            block = self.allocate(_rounded(floats))
            self.allocated += 1
            self.blocks.append(block)
            free.append(block)
        # blocks nobody uses beyond `keep` are let go (the largest kept: they fit every call)
        spare = sorted((b for b in free if b is not block), key=len, reverse=True)[self.keep - 1 :]
        if spare:
            ids = {id(b) for b in spare}
            self.blocks = [b for b in self.blocks if id(b) not in ids]
        return block

    @property
    def held_bytes(self) -> int:
        return sum(b.nbytes for b in self.blocks)
