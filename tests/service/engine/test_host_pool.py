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
