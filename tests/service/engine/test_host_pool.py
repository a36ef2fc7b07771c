"""The host pool the window graph's outputs are written into: a block is lent again only once no view of it is
alive, free blocks beyond `keep` are let go, and a block's memory lives as long as any view of it."""

from __future__ import annotations

import gc

import numpy as np

from service.engine import host_pool
from service.engine.host_pool import HostPool


def test_a_block_viewed_anywhere_is_not_lent_again():
    pool = HostPool(keep=2)
    first = pool.take(1000)
    view = first[10:20].reshape(2, 5)[1:]  # a view of a view: numpy's base is still the block
    first[:] = 1.0
    del first
    second = pool.take(1000)  # the first block is still viewed: a new one
    second[:] = 2.0
    assert pool.allocated == 2 and np.all(view == 1.0)
    del second
    assert pool.take(1000) is not None and pool.allocated == 2  # the second is free: lent again
    del view
    gc.collect()
    blocks = {id(pool.take(600)) for _ in range(3)}
    assert pool.allocated == 2 and len(blocks) == 1  # both free now; the smallest fitting is lent, the same one


def test_sizes_round_up_and_spare_blocks_beyond_keep_are_let_go():
    pool = HostPool(keep=1)
    held = [pool.take(n) for n in (100, 300, 1000)]
    assert [len(b) for b in held] == [112, 320, 1024]  # up to an eighth of the next power of two
    del held
    pool.take(10)
    assert len(pool.blocks) == 1  # the one lent; the spare ones dropped (memory goes with the last view)


def test_pinned_memory_falls_back_to_numpy_without_the_cuda_runtime(monkeypatch):
    # The page-locked allocator needs libcudart (a GPU host); without it the pool lends ordinary numpy memory.
    monkeypatch.setattr(host_pool, "cudart", lambda: None)
    assert host_pool.pinned_allocator() is host_pool.numpy_allocator


class FakeCudaRuntime:
    """A stand-in for libcudart (a mock: this machine has no GPU, so the real library cannot run here): the calls the
    pinned allocator makes, recorded in order, with host memory from ctypes in place of page-locked memory."""

    def __init__(self, device: int = 0):
        self.device, self.calls, self.buffers = device, [], {}

    def cudaGetDevice(self, device):
        device._obj.value = self.device
        self.calls.append(("get", self.device))
        return 0

    def cudaSetDevice(self, device: int):
        self.device = device
        self.calls.append(("set", device))
        return 0

    def cudaHostAlloc(self, pointer, size, flags):
        import ctypes

        buffer = ctypes.create_string_buffer(size.value)
        pointer._obj.value = ctypes.addressof(buffer)
        self.buffers[ctypes.addressof(buffer)] = buffer
        self.calls.append(("alloc", self.device, size.value))
        return 0

    def cudaFreeHost(self, pointer):
        self.calls.append(("free", self.buffers.pop(pointer.value) is not None))
        return 0


def test_pinned_blocks_are_allocated_on_the_sessions_device_and_the_current_device_is_restored(monkeypatch):
    # On a multi-GPU host pinned memory belongs to the device current when it is allocated: a session on device 1
    # must allocate its blocks with device 1 current, and leave the caller's device (0) current after.
    runtime = FakeCudaRuntime(device=0)
    monkeypatch.setattr(host_pool, "cudart", lambda: runtime)
    pool = HostPool(host_pool.pinned_allocator(device_id=1))
    block = pool.take(1000)
    block[:] = 3.0  # the memory is usable through the numpy view
    assert runtime.calls == [("get", 0), ("set", 1), ("alloc", 1, 4 * len(block)), ("set", 0)]
    assert runtime.device == 0 and float(block.sum()) == 3.0 * len(block)
    del block, pool
    gc.collect()
    assert runtime.calls[-1] == ("free", True) and not runtime.buffers  # freed with its last view
