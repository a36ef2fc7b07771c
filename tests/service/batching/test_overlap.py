"""The batcher on the window graph builds call N+1's feeds while call N runs (a GPU's engine thread waits for its
call with the interpreter lock let go). A real ONNX Runtime session on the tiny model, each call held longer after
its run (as a GPU's call keeps the engine thread waiting: `SlowCalls`), records when each call ran and when, and on
which thread, its feeds were built; the answers stay every request's own to 1e-5."""

from __future__ import annotations

import asyncio
import gc
import itertools
import threading
import time

import numpy as np
import pytest

from service.batching.batcher import Batcher
from service.batching.in_flight import in_flight
from service.engine.session import Engine
from tests.service.batching.test_batcher import TIMEOUT_S, EngineFailure, make_sentences, run, wait_until

CALL_S = 0.15  # what each call is held after ONNX Runtime's run: the device's time, here slept


@pytest.fixture(scope="module")
def window_engine(tiny_model_dir) -> Engine:
    return Engine(tiny_model_dir, provider="cpu", graph="window", intra_op_threads=1)


class SlowCalls:
    """The real window engine; each call held CALL_S after its run; records (start, end, prepared) per call and
    (start, end, thread, prepared) per feeds built; a call computing a sentence that holds `poison` raises."""

    def __init__(self, engine: Engine, poison: str | None = None, seconds: float = CALL_S):
        self.engine, self.poison, self.seconds = engine, poison, seconds
        self.calls: list[tuple[float, float, object]] = []
        self.built: list[tuple[float, float, str, object]] = []
        self.computed: list[list[list[str]]] = []  # the sentences of each call (the tags are cleared once answered)

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def prepare_packed(self, rows, source):
        start = time.perf_counter()
        prepared = self.engine.prepare_packed(rows, source)
        self.built.append((start, time.perf_counter(), threading.current_thread().name, prepared))
        return prepared

    def call_packed(self, rows, source):  # without overlap: built and run in series, on the engine thread
        return self.run_prepared(self.prepare_packed(rows, source))

    def run_prepared(self, prepared):
        start = time.perf_counter()
        sentences = [s.tag[0].sentences[s.tag[1]] for row in prepared.rows for s, _, _ in row]
        if self.poison is not None and any(self.poison in s for s in sentences):
            time.sleep(CALL_S)  # the device's error is seen when the call ends
            self.failed = (start, time.perf_counter())
            raise EngineFailure("boom")
        padded = self.engine.run_prepared(prepared)
        time.sleep(self.seconds)
        self.calls.append((start, time.perf_counter(), prepared))
        self.computed.append(sentences)
        return padded

    def overlapped(self) -> int:
        """Calls whose feeds were built on the preparing thread before the call before them returned."""
        built = {id(p): (end, thread) for _, end, thread, p in self.built}
        return sum(built[id(p)][1] == "elmo-prepare" and built[id(p)][0] < before_end
                   for (_, before_end, _), (_, _, p) in itertools.pairwise(self.calls))  # fmt: skip


def retries(engine: Engine, poison: str | None = None):
    def run_whole(sentences):
        if poison is not None and any(poison in s for s in sentences):
            raise EngineFailure("boom")
        return engine.run(sentences, boundaries=True)

    return run_whole


def assert_alone(engine: Engine, sentences, got) -> None:
    for s, layers in zip(sentences, got, strict=True):
        np.testing.assert_allclose(layers.result(), engine.run([s])[0], rtol=0, atol=1e-5)


@pytest.mark.parametrize("overlap", [True, False])
def test_under_load_each_calls_feeds_are_built_while_the_call_before_runs(window_engine, overlap):
    # 24 requests queued at once, a budget of about 5 sentences: several calls, each filled from the queue by the
    # preparing thread while the one before runs (the sentences it finishes no longer counted against the budget)
    slow = SlowCalls(window_engine)
    requests = [[s] for s in make_sentences(24, seed=3)]

    async def main():
        batcher = Batcher(retries(window_engine), in_flight(slow, 4), 60, 0.2, 100_000, overlap=overlap)
        batcher.start()
        got = await asyncio.gather(*(batcher.embed(r) for r in requests))
        await batcher.stop()
        return batcher, got

    batcher, got = run(main)
    packed = batcher._in_flight.packed
    calls = len(slow.calls)
    assert calls >= 5  # the budget spreads them
    if overlap:
        assert slow.overlapped() >= calls - 2  # the first call's feeds are built in series, and maybe the one after
        assert packed.replanned == 0 and packed.prepare_s > 0  # every sentence waited before its call was planned
    else:
        assert slow.overlapped() == 0
    for request, layers in zip(requests, got, strict=True):
        assert_alone(window_engine, request, layers)


def test_a_request_queued_while_a_call_runs_joins_the_next_call(window_engine):
    # the long sentence runs 3 calls; the short one is sent once call 2 has been prepared beside call 1 (without
    # it): call 2 is built again with it, so it is answered after call 2, not 3
    long, short = ["long"] * 70, ["short", "one"]
    slow = SlowCalls(window_engine)

    async def main():
        batcher = Batcher(retries(window_engine), in_flight(slow, 4), 4096, 0.0, 100_000)
        batcher.start()
        first = asyncio.ensure_future(batcher.embed([long]))
        await wait_until(lambda: len(slow.built) == 2 and not slow.calls)  # call 2 built while call 1 runs
        second = await batcher.embed([short])
        answered_at = len(slow.calls)
        got = await first
        await batcher.stop()
        return batcher, got, second, answered_at

    batcher, got_long, got_short, answered_at = run(main)
    assert slow.computed == [[long], [long, short], [long]] and answered_at == 2
    assert batcher._in_flight.packed.replanned == 1
    assert_alone(window_engine, [long], got_long)
    assert_alone(window_engine, [short], got_short)


def test_a_call_that_fails_with_the_next_one_prepared_fails_only_its_own_request(window_engine):
    # the poisoned sentence's call fails while the next call's feeds are built beside it; every sentence of both is
    # handed back, run again whole in halves, and only the poisoned request gets the error
    slow = SlowCalls(window_engine, poison="poison")
    requests = [[s] for s in make_sentences(16, seed=5)]
    requests[6] = [["a", "poison", "pill"]]

    async def main():
        batcher = Batcher(retries(window_engine, "poison"), in_flight(slow, 4), 60, 0.2, 100_000)
        batcher.start()
        got = await asyncio.gather(*(batcher.embed(r) for r in requests), return_exceptions=True)
        await batcher.stop()
        return got

    got = run(main)
    assert isinstance(got[6], EngineFailure)
    _, failed_end = slow.failed  # the next call's feeds were built beside the failed call (then dropped)
    assert any(thread == "elmo-prepare" and start < failed_end for start, _, thread, _ in slow.built)
    for i, (request, layers) in enumerate(zip(requests, got, strict=True)):
        if i != 6:
            assert_alone(window_engine, request, layers)


def test_an_answered_request_lets_its_calls_output_blocks_go_without_the_garbage_collector(window_engine):
    # a sentence's result is views of its calls' pooled output blocks; the request held the sentence and the
    # sentence (its routing tag) the request: a cycle that kept every block until a collection, so the pool made a
    # fresh block for nearly every call (bench.host: 26 blocks in 17 calls, first-touch copies 10x slower)
    pool = window_engine._window.pool

    async def main():
        batcher = Batcher(retries(window_engine), in_flight(window_engine, 4), 4096, 0.0, 100_000)
        batcher.start()
        for _ in range(6):  # 3 calls each
            got = await batcher.embed([["long"] * 70, ["short"]])
            assert got[0].result().shape == (window_engine.num_layers, 70, window_engine.dim)
            del got
        await batcher.stop()

    gc.disable()
    try:
        before = pool.allocated
        run(main)
        assert pool.allocated - before <= 2  # 18 calls
    finally:
        gc.enable()


def test_a_request_cancelled_while_its_sentence_waits_in_the_prepared_call_is_not_computed(window_engine):
    # call 2 is prepared beside call 1 with the long sentence's second window and the other request's sentence (the
    # preparing thread's intake is held until the other is queued); that request is cancelled while call 1 runs:
    # call 2 is planned again without it, and nothing of it is computed
    long, other = ["long"] * 70, ["other", "one"]
    slow = SlowCalls(window_engine, seconds=0.5)
    queued = threading.Event()

    async def main():
        batcher = Batcher(retries(window_engine), in_flight(slow, 4), 4096, 0.0, 100_000)
        thread = batcher._engine  # the engine thread's intake, run on the preparing thread, held
        intake = thread._intake
        thread._intake = lambda: queued.wait(TIMEOUT_S) and intake()
        batcher.start()
        first = asyncio.ensure_future(batcher.embed([long]))
        await wait_until(lambda: len(slow.built) == 1)  # call 1 built: the long one alone
        second = asyncio.ensure_future(batcher.embed([other]))
        await wait_until(lambda: batcher.queued_tokens == 4)
        queued.set()
        await wait_until(lambda: len(slow.built) == 2)  # call 2 built beside call 1, with the other one
        assert not slow.calls and batcher.queued_tokens == 0  # call 1 still runs; the other one was taken
        second.cancel()
        got = await first
        await batcher.stop()
        return batcher, got, second

    batcher, got, second = run(main)
    assert second.cancelled() and slow.computed == [[long], [long], [long]]
    assert batcher._in_flight.packed.replanned == 1
    assert_alone(window_engine, [long], got)


def test_the_only_request_cancelled_with_its_next_call_prepared_leaves_the_engine_idle(window_engine):
    # the long sentence (3 calls) alone; its client goes while call 1 runs, call 2 prepared beside it: the sentence's
    # row is emptied, and nothing is in flight any more. A review found the empty row counted as "busy": the engine
    # thread spun without waiting, and stop() never returned
    long = ["long"] * 70
    slow = SlowCalls(window_engine, seconds=0.3)

    async def main():
        batcher = Batcher(retries(window_engine), in_flight(slow, 4), 4096, 0.0, 100_000)
        batcher.start()
        first = asyncio.ensure_future(batcher.embed([long]))
        await wait_until(lambda: len(slow.built) == 2 and not slow.calls)  # call 2 built while call 1 runs
        first.cancel()
        await wait_until(lambda: not batcher._in_flight.busy)
        calls = len(slow.calls)
        await asyncio.sleep(0.3)
        idle = len(slow.calls) == calls and not batcher._in_flight.busy
        await asyncio.wait_for(batcher.stop(), 5)
        return first, idle

    first, idle = run(main)
    assert first.cancelled() and idle
    assert len(slow.computed) <= 2  # call 1, and at most the prepared call 2; never call 3
