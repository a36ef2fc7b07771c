"""The dynamic batcher with the real tiny engine: who gets which rows, how batches are cut, back-pressure,
cancellation, failures and shutdown. The engine is wrapped to record every batch it is given, and can be held
(a threading.Event) so that requests pile up deterministically while it is busy."""

from __future__ import annotations

import asyncio
import random
import threading
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, TypeVar

import numpy as np
import pytest

from service.batcher import Batcher, BatchStats, QueueFull, TooLarge

T = TypeVar("T")
TIMEOUT_S = 20.0  # a test that would hang fails after this instead
_RECORDERS: list[Recorder] = []


class EngineFailure(RuntimeError):
    pass


class Recorder:
    """engine.run, recording each batch; `hold()` makes the next batches wait until `release()`;
    a batch holding `poison` among its tokens raises EngineFailure."""

    def __init__(self, engine, poison: str | None = None):
        self.engine = engine
        self.poison = poison
        self.calls: list[list[list[str]]] = []
        self.entered = threading.Event()
        self._gate = threading.Event()
        self._gate.set()
        _RECORDERS.append(self)

    def hold(self) -> None:
        self.entered.clear()
        self._gate.clear()

    def release(self) -> None:
        self._gate.set()

    @property
    def held(self) -> bool:
        return not self._gate.is_set()

    def __call__(self, sentences: Sequence[Sequence[str]]) -> list[np.ndarray]:
        self.calls.append([list(s) for s in sentences])
        self.entered.set()
        if not self._gate.wait(TIMEOUT_S):
            raise RuntimeError("the test never released the engine")
        if self.poison is not None and any(self.poison in s for s in sentences):
            raise EngineFailure("boom")
        return self.engine.run(sentences)

    def seen(self) -> list[list[str]]:
        return [s for call in self.calls for s in call]


def run(main: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """asyncio.run with a time limit; whatever happens, no engine thread is left held."""
    try:
        return asyncio.run(asyncio.wait_for(main(), TIMEOUT_S))
    finally:
        while _RECORDERS:
            _RECORDERS.pop().release()


async def wait_until(condition: Callable[[], bool]) -> None:
    """Let the loop (and the engine thread) run until condition() holds."""
    loop = asyncio.get_running_loop()
    end = loop.time() + TIMEOUT_S
    while not condition():
        assert loop.time() < end, "condition never held"
        await asyncio.sleep(0.001)


async def start_blocked(batcher: Batcher, recorder: Recorder) -> asyncio.Task:
    """Send a request of its own and hold the engine on it: everything sent next waits in the queue."""
    recorder.hold()
    blocker = asyncio.ensure_future(batcher.embed([BLOCKER]))
    await wait_until(recorder.entered.is_set)
    assert batcher.busy and batcher.queued_tokens == 0
    return blocker


async def queued_behind_a_blocker(batcher: Batcher, recorder: Recorder, requests) -> list:
    """Queue every request while the engine is held on a blocker, then let it go, so the batcher cuts them all
    in one go; stops the batcher and returns the requests' results (without the blocker's)."""
    blocker = await start_blocked(batcher, recorder)
    tasks = [asyncio.ensure_future(batcher.embed(r)) for r in requests]
    await wait_until(lambda: batcher.queued_tokens == sentence_tokens(s for r in requests for s in r))
    recorder.release()
    results = await asyncio.gather(blocker, *tasks)
    await batcher.stop()
    return results[1:]


BLOCKER = ["held", "on", "purpose"]
WORDS = [
    "the",
    "a",
    "cat",
    "dog",
    "sat",
    "on",
    "mat",
    ",",
    ".",
    "quickly",
    "Über",
    "naïve",
    "U.S.",
    "42",
    "bio-identical",
]


def make_sentences(n: int, seed: int, max_len: int = 12) -> list[list[str]]:
    rng = random.Random(seed)
    return [[rng.choice(WORDS) for _ in range(rng.randint(1, max_len))] for _ in range(n)]


def sentence_tokens(sentences) -> int:
    return sum(len(s) + 2 for s in sentences)


def assert_own_rows(engine, sentences, got) -> None:
    assert len(got) == len(sentences)
    for s, g in zip(sentences, got, strict=True):
        (want,) = engine.run([s])
        assert g.shape == want.shape == (engine.num_layers, len(s), engine.dim)
        # Alone or in any batch: within the 1e-6 bar (on CPU the same bits; a row of another sentence is off by ~1).
        np.testing.assert_allclose(g, want, rtol=0, atol=1e-6)


def assert_within_budget(calls, batch_tokens: int) -> None:
    for call in calls:
        lengths = [len(s) for s in call]
        assert lengths == sorted(lengths, reverse=True), "a batch is not length-sorted"
        padded = len(call) * (max(lengths) + 2)
        assert padded <= batch_tokens or len(call) == 1, (padded, batch_tokens)


def test_every_request_gets_its_own_rows(engine):
    requests = [make_sentences(random.Random(i).randint(1, 5), seed=i) for i in range(24)]

    async def main():
        recorder = Recorder(engine)
        batcher = Batcher(recorder, batch_tokens=64, max_wait_s=0.002, queue_tokens=100_000)
        batcher.start()
        # Some arrive together, some a little later: batches mix requests in every way.
        first = [asyncio.ensure_future(batcher.embed(r)) for r in requests[:12]]
        await asyncio.sleep(0)
        later = []
        for r in requests[12:]:
            later.append(asyncio.ensure_future(batcher.embed(r)))
            await asyncio.sleep(0.001)
        results = await asyncio.gather(*first, *later)
        await batcher.stop()
        return recorder, results

    recorder, results = run(main)
    for sentences, got in zip(requests, results, strict=True):
        assert_own_rows(engine, sentences, got)
    # The engine saw every sentence exactly once, and some batches held several requests' sentences.
    assert sorted(map(tuple, recorder.seen())) == sorted(tuple(s) for r in requests for s in r)
    assert len(recorder.calls) < len(requests)


def test_batches_respect_the_token_budget_and_are_length_sorted(engine):
    batch_tokens = 40
    requests = [make_sentences(3, seed=100 + i, max_len=15) for i in range(10)]
    requests.append([["long"] * 45])  # alone over the budget: a batch of its own
    stats: list[BatchStats] = []

    async def main():
        recorder = Recorder(engine)
        batcher = Batcher(recorder, batch_tokens, max_wait_s=0.0, queue_tokens=100_000, on_batch=stats.append)
        batcher.start()
        return recorder, await queued_behind_a_blocker(batcher, recorder, requests)

    recorder, results = run(main)
    for sentences, got in zip(requests, results, strict=True):
        assert_own_rows(engine, sentences, got)
    calls = recorder.calls[1:]  # after the blocker: all queued requests were cut in one go
    assert_within_budget(calls, batch_tokens)
    assert calls[0] == [["long"] * 45]
    # Sorted across the batches too, and each batch as full as the budget allows (the last may be short).
    lengths = [len(s) for call in calls for s in call]
    assert lengths == sorted(lengths, reverse=True)
    for call in calls[:-1]:
        assert len(call) == max(1, batch_tokens // (len(call[0]) + 2))
    # The metrics hook sees the same batches.
    assert [(b.sentences, b.padded_tokens, b.real_tokens) for b in stats[1:]] == [
        (len(c), len(c) * (len(c[0]) + 2), sum(map(len, c))) for c in calls
    ]


def test_a_request_larger_than_a_batch_is_split_and_answered_in_order(engine):
    batch_tokens = 24
    sentences = make_sentences(30, seed=7, max_len=10)
    assert sentence_tokens(sentences) > 3 * batch_tokens

    async def main():
        recorder = Recorder(engine)
        batcher = Batcher(recorder, batch_tokens, max_wait_s=0.0, queue_tokens=100_000)
        batcher.start()
        got = await batcher.embed(sentences)
        await batcher.stop()
        return recorder, got

    recorder, got = run(main)
    assert len(recorder.calls) >= 3
    assert_within_budget(recorder.calls, batch_tokens)
    assert sorted(map(tuple, recorder.seen())) == sorted(map(tuple, sentences))
    assert_own_rows(engine, sentences, got)  # in the request's order, not the batches'


def test_concurrent_small_requests_are_merged(engine):
    requests = [make_sentences(1, seed=200 + i, max_len=6) for i in range(16)]

    async def main():
        recorder = Recorder(engine)
        batcher = Batcher(recorder, batch_tokens=4096, max_wait_s=0.002, queue_tokens=100_000)
        batcher.start()
        results = await asyncio.gather(*(batcher.embed(r) for r in requests))
        # While the engine is busy, more requests wait in the queue and go in one batch afterwards.
        return recorder, results, await queued_behind_a_blocker(batcher, recorder, requests)

    recorder, results, later = run(main)
    # Arriving together: one engine call for all 16; behind a busy engine: the blocker's, then one more.
    assert [len(c) for c in recorder.calls] == [16, 1, 16]
    assert recorder.calls[1] == [BLOCKER]
    for sentences, a, b in zip(requests, results, later, strict=True):
        assert_own_rows(engine, sentences, a)
        assert_own_rows(engine, sentences, b)


def test_an_idle_engine_waits_for_more_until_a_batch_is_full(engine):
    # A lone request waits up to max_wait for company; a second one that fills the batch ends the wait early.
    a, b = [["one", "two", "three", "four"]], [["five", "six", "seven", "eight"]]

    async def main():
        recorder = Recorder(engine)
        batcher = Batcher(recorder, batch_tokens=2 * 6, max_wait_s=TIMEOUT_S, queue_tokens=100_000)
        batcher.start()
        first = asyncio.ensure_future(batcher.embed(a))
        await wait_until(lambda: batcher.queued_tokens == 6)
        for _ in range(20):
            await asyncio.sleep(0)
        assert recorder.calls == [] and not first.done()  # still waiting for company
        results = await asyncio.gather(first, batcher.embed(b))
        await batcher.stop()
        return recorder, results

    recorder, (got_a, got_b) = run(main)
    assert recorder.calls == [a + b]
    assert_own_rows(engine, a, got_a)
    assert_own_rows(engine, b, got_b)


def test_a_lone_request_goes_when_max_wait_is_over(engine):
    # Nobody else comes and the batch is far from full: it still runs once max_wait has passed.
    async def main():
        recorder = Recorder(engine)
        batcher = Batcher(recorder, batch_tokens=100_000, max_wait_s=0.01, queue_tokens=100_000)
        batcher.start()
        got = await asyncio.wait_for(batcher.embed([["alone"]]), TIMEOUT_S)
        again = await asyncio.wait_for(batcher.embed([["again", "alone"]]), TIMEOUT_S)
        await batcher.stop()
        return recorder, got, again

    recorder, got, again = run(main)
    assert recorder.calls == [[["alone"]], [["again", "alone"]]]
    assert_own_rows(engine, [["alone"]], got)
    assert_own_rows(engine, [["again", "alone"]], again)


def test_queue_full_is_raised_at_once_and_clears_after_draining(engine):
    eight = ["w"] * 8  # 10 tokens with its boundaries

    async def main():
        recorder = Recorder(engine)
        batcher = Batcher(recorder, batch_tokens=4096, max_wait_s=0.0, queue_tokens=20)
        batcher.start()
        blocker = await start_blocked(batcher, recorder)
        first = asyncio.ensure_future(batcher.embed([eight]))
        second = asyncio.ensure_future(batcher.embed([eight]))
        await wait_until(lambda: batcher.queued_tokens == 20)  # exactly full is still accepted
        with pytest.raises(QueueFull):
            await batcher.embed([["x"]])
        with pytest.raises(TooLarge, match=r"21 tokens .* the limit is 20"):
            await batcher.embed([["x"] * 19])  # would never fit, even in an empty queue: no use retrying
        # Refused at once: the engine is still held, nothing was added, nothing else ran.
        assert recorder.held and len(recorder.calls) == 1
        assert batcher.queued_tokens == 20
        recorder.release()
        results = await asyncio.gather(blocker, first, second)
        assert batcher.queued_tokens == 0
        again = await batcher.embed([["x"], eight])  # 13 tokens: accepted now
        with pytest.raises(TooLarge):
            await batcher.embed([["x"] * 19])
        await batcher.stop()
        return recorder, results, again

    recorder, results, again = run(main)
    assert_own_rows(engine, [eight], results[1])
    assert_own_rows(engine, [eight], results[2])
    assert_own_rows(engine, [["x"], eight], again)
    assert ["x"] * 19 not in recorder.seen()


def test_a_cancelled_request_never_reaches_the_engine(engine):
    gone = ["client", "went", "away"]
    stays = ["still", "here"]

    async def main():
        recorder = Recorder(engine)
        batcher = Batcher(recorder, batch_tokens=4096, max_wait_s=0.0, queue_tokens=1000)
        batcher.start()
        blocker = await start_blocked(batcher, recorder)
        cancelled = asyncio.ensure_future(batcher.embed([gone, gone]))
        kept = asyncio.ensure_future(batcher.embed([stays]))
        await wait_until(lambda: batcher.queued_tokens == 2 * 5 + 4)
        cancelled.cancel()
        await asyncio.gather(cancelled, return_exceptions=True)
        assert cancelled.cancelled()
        assert batcher.queued_tokens == 4  # its tokens left the queue with it
        recorder.release()
        await asyncio.gather(blocker, kept)
        assert batcher.queued_tokens == 0
        await batcher.stop()
        return recorder, kept.result()

    recorder, kept = run(main)
    assert gone not in recorder.seen()
    assert recorder.calls == [[BLOCKER], [stays]]
    assert_own_rows(engine, [stays], kept)


def test_a_request_cancelled_after_being_taken_is_dropped_before_its_batch(engine):
    # Taken from the queue together with a longer request, but cut into a later batch: cancelling it while
    # the first batch runs keeps it from the engine.
    long = ["a"] * 10  # 12 tokens: one batch by itself
    gone = ["b", "c"]

    async def main():
        recorder = Recorder(engine)
        batcher = Batcher(recorder, batch_tokens=12, max_wait_s=0.0, queue_tokens=1000)
        batcher.start()
        recorder.hold()
        first = asyncio.ensure_future(batcher.embed([long]))
        cancelled = asyncio.ensure_future(batcher.embed([gone]))
        await wait_until(recorder.entered.is_set)
        assert recorder.calls == [[long]] and batcher.queued_tokens == 0
        cancelled.cancel()
        await asyncio.gather(cancelled, return_exceptions=True)
        recorder.release()
        got = await first
        after = await batcher.embed([["next"]])
        assert batcher.queued_tokens == 0
        await batcher.stop()
        return recorder, got, after, cancelled

    recorder, got, after, cancelled = run(main)
    assert cancelled.cancelled()
    assert recorder.calls == [[long], [["next"]]]
    assert_own_rows(engine, [long], got)
    assert_own_rows(engine, [["next"]], after)


def test_a_failed_batch_is_run_in_halves_and_only_the_failing_sentence_fails(engine):
    long = ["fine"] * 10  # 12 tokens: a batch of its own with batch_tokens=12
    poisoned = ["BOOM", "x"]  # shares a batch with `neighbour`
    neighbour = ["y", "z"]
    stats: list[BatchStats] = []

    async def main():
        recorder = Recorder(engine, poison="BOOM")
        batcher = Batcher(recorder, batch_tokens=12, max_wait_s=0.0, queue_tokens=1000, on_batch=stats.append)
        batcher.start()
        blocker = await start_blocked(batcher, recorder)
        tasks = [
            asyncio.ensure_future(batcher.embed(r))
            for r in ([poisoned], [neighbour], [long], [long, poisoned])  # the last spans two batches
        ]
        await wait_until(lambda: batcher.queued_tokens == 4 + 4 + 12 + 16)
        recorder.release()
        results = await asyncio.gather(blocker, *tasks, return_exceptions=True)
        # The batcher is still serving.
        after = await batcher.embed([neighbour, long])
        await batcher.stop()
        return recorder, results[1:], after

    recorder, (r_poisoned, r_neighbour, r_long, r_mixed), after = run(main)
    assert isinstance(r_poisoned, EngineFailure)
    assert isinstance(r_mixed, EngineFailure)  # its long sentence was fine, its other one was not
    assert_own_rows(engine, [neighbour], r_neighbour)  # shared the failed batch: answered from a half
    assert_own_rows(engine, [long], r_long)
    assert_own_rows(engine, [neighbour, long], after)
    failed = [poisoned, neighbour, poisoned]
    assert recorder.calls[1:] == [
        [long], [long], failed, failed[:1], failed[1:], [neighbour], [poisoned], [long], [neighbour]
    ]  # fmt: skip
    assert len(stats) == len(recorder.calls) - 4  # no metrics for the failed batches


class OutOfMemory(RuntimeError):
    pass


class SmallBatchesOnly:
    """An engine double that fails like a GPU out of memory on any batch of more than `rows` sentences,
    whatever they are (a real out-of-memory cannot be produced on this CPU-only machine)."""

    def __init__(self, engine, rows: int):
        self.engine, self.rows = engine, rows

    def run(self, sentences):
        if len(sentences) > self.rows:
            raise OutOfMemory("Failed to allocate memory for requested buffer")
        return self.engine.run(sentences)


def test_an_out_of_memory_batch_is_answered_in_smaller_batches(engine):
    requests = [make_sentences(3, seed=400 + i, max_len=6) for i in range(5)]

    async def main():
        recorder = Recorder(SmallBatchesOnly(engine, rows=3))
        batcher = Batcher(recorder, batch_tokens=4096, max_wait_s=0.0, queue_tokens=100_000)
        batcher.start()
        return recorder, await queued_behind_a_blocker(batcher, recorder, requests)

    recorder, results = run(main)
    for sentences, got in zip(requests, results, strict=True):
        assert_own_rows(engine, sentences, got)
    sizes = [len(call) for call in recorder.calls[1:]]
    assert sizes[0] == 15 and max(size for size in sizes if size <= 3) == 3
    assert sum(size for size in sizes if size <= 3) == 15  # every sentence ran once in a batch that worked


def test_stop_finishes_queued_work_first(engine):
    requests = [make_sentences(2, seed=300 + i) for i in range(6)]
    order: list[str] = []

    async def request(batcher, i):
        result = await batcher.embed(requests[i])
        order.append(f"request {i}")
        return result

    async def main():
        recorder = Recorder(engine)
        batcher = Batcher(recorder, batch_tokens=32, max_wait_s=0.0, queue_tokens=100_000)
        batcher.start()
        blocker = await start_blocked(batcher, recorder)
        tasks = [asyncio.ensure_future(request(batcher, i)) for i in range(len(requests))]
        await wait_until(lambda: batcher.queued_tokens == sentence_tokens(s for r in requests for s in r))
        stopping = asyncio.ensure_future(batcher.stop())
        for _ in range(20):
            await asyncio.sleep(0)
        assert not stopping.done()  # it cannot be done while work is queued
        recorder.release()
        await stopping
        order.append("stopped")
        await blocker
        return recorder, await asyncio.gather(*tasks)

    recorder, results = run(main)
    assert order[-1] == "stopped" and sorted(order[:-1]) == sorted(f"request {i}" for i in range(len(requests)))
    for sentences, got in zip(requests, results, strict=True):
        assert_own_rows(engine, sentences, got)
    assert sorted(map(tuple, recorder.seen()[1:])) == sorted(tuple(s) for r in requests for s in r)


def test_an_empty_request_is_answered_at_once(engine):
    async def main():
        recorder = Recorder(engine)
        batcher = Batcher(recorder, batch_tokens=64, max_wait_s=0.0, queue_tokens=100)
        batcher.start()
        got = await asyncio.wait_for(batcher.embed([]), TIMEOUT_S)
        after = await batcher.embed([["ok"]])
        await batcher.stop()
        return recorder, got, after

    recorder, got, after = run(main)
    assert got == []
    assert recorder.calls == [[["ok"]]]
    assert_own_rows(engine, [["ok"]], after)


def test_clients_answered_together_are_waited_for_together(engine):
    """After a round that answered several requests, the next batch waits (up to `gather`) until as many
    are back, so steady concurrent clients share one batch instead of alternating smaller ones."""
    recorder = Recorder(engine)

    async def main():
        batcher = Batcher(recorder, batch_tokens=4096, max_wait_s=0.0, queue_tokens=100_000, gather_s=5.0)
        batcher.start()
        first = make_sentences(2, seed=1)
        await asyncio.gather(*(batcher.embed([s]) for s in first))  # one round of 2 requests
        calls = len(recorder.calls)
        again = [asyncio.ensure_future(batcher.embed([s])) for s in first[:1]]
        await asyncio.sleep(0.05)  # the second client is slower to come back
        assert len(recorder.calls) == calls  # not run yet, although max_wait is 0
        again.append(asyncio.ensure_future(batcher.embed([first[1]])))
        await asyncio.gather(*again)
        assert recorder.calls[calls:] == [sorted(first, key=len, reverse=True)]  # one batch for both
        lone = await batcher.embed([first[0]])  # a round of one request sets no wait for the next one
        await batcher.stop()
        return lone

    assert run(main)[0].shape[1] == len(make_sentences(2, seed=1)[0])
