"""The batcher with the real tiny engine and in_flight: who gets which rows, how sentences join and leave the
windows, the token budget, back-pressure, cancellation, failures and shutdown. The in_flight is wrapped to record
every window it runs, and can be held (a threading.Event) so that requests pile up deterministically while it is
busy; a sentence holding a poison token makes a window (or a whole retry) fail."""

from __future__ import annotations

import asyncio
import random
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import numpy as np
import pytest

from service.batching.batcher import Batcher, BatchStats, LargerThanQueue, QueueFull
from service.batching.in_flight import in_flight

T = TypeVar("T")
TIMEOUT_S = 20.0  # a test that would hang fails after this instead
_HELD: list[RecordingStepper] = []


class EngineFailure(RuntimeError):
    pass


class RecordingStepper:
    """A real in-flight set (the engine's kind) that records the sentences of each window (and each admission);
    `hold()` makes the next window wait until `release()`; a window with `poison` in flight, or with more than
    `max_rows` rows, raises (the latter like a GPU out of memory, which cannot happen on this CPU-only machine)."""

    def __init__(self, engine, window: int = 4, poison: str | None = None, max_rows: int | None = None):
        self.inner = in_flight(engine, window)
        self.poison, self.max_rows = poison, max_rows
        self.windows: list[list[list[str]]] = []
        self.lengths: list[int | None] = []  # the window length each call was given
        self.admitted: list[list[str]] = []
        self.entered = threading.Event()
        self._gate = threading.Event()
        self._gate.set()
        self.hold_at: int | None = None  # the window (counted from 1) that waits for `release()` again
        _HELD.append(self)

    def hold(self) -> None:
        self.entered.clear()
        self._gate.clear()

    def release(self) -> None:
        self._gate.set()

    def __getattr__(self, name):  # rows, room, drop, clear, engine, window, last_call: the real set's
        return getattr(self.inner, name)

    def admit(self, sentences, tags) -> None:
        self.admitted += [list(s) for s in sentences]
        self.inner.admit(sentences, tags)

    def step(self, window=None, intake=None):
        sentences = [row.tag[0].sentences[row.tag[1]] for row in self.rows]
        if len(self.windows) + 1 == self.hold_at:  # before it is recorded: a test that sees it may release it
            self._gate.clear()
        self.windows.append(sentences)
        self.lengths.append(window)
        self.entered.set()
        if not self._gate.wait(TIMEOUT_S):
            raise RuntimeError("the test never released the in_flight")
        if self.poison is not None and any(self.poison in s for s in sentences):
            raise EngineFailure("boom")
        if self.max_rows is not None and len(sentences) > self.max_rows:
            raise MemoryError("Failed to allocate memory for requested buffer")
        return self.inner.step(window, intake)


class RecordingRun:
    """engine.run for the whole retries after a failed window, recording each call; fails like the in_flight."""

    def __init__(self, engine, poison: str | None = None, max_rows: int | None = None):
        self.engine, self.poison, self.max_rows = engine, poison, max_rows
        self.calls: list[list[list[str]]] = []

    def __call__(self, sentences):
        self.calls.append([list(s) for s in sentences])
        if self.poison is not None and any(self.poison in s for s in sentences):
            raise EngineFailure("boom")
        if self.max_rows is not None and len(sentences) > self.max_rows:
            raise MemoryError("Failed to allocate memory for requested buffer")
        return self.engine.run(sentences, boundaries=True)


def make(engine, batch_tokens=4096, max_wait_s=0.0, queue_tokens=100_000, window=4, poison=None, max_rows=None,
         stats=None) -> tuple[Batcher, RecordingStepper, RecordingRun]:  # fmt: skip
    in_flight = RecordingStepper(engine, window, poison, max_rows)
    run = RecordingRun(engine, poison, max_rows)
    on_batch = None if stats is None else stats.append
    batcher = Batcher(run, in_flight, batch_tokens, max_wait_s, queue_tokens, on_batch=on_batch)
    batcher.start()
    return batcher, in_flight, run


def run(main: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """asyncio.run with a time limit; whatever happens, no engine thread is left held."""
    try:
        return asyncio.run(asyncio.wait_for(main(), TIMEOUT_S))
    finally:
        while _HELD:
            _HELD.pop().release()


async def wait_until(condition: Callable[[], bool]) -> None:
    """Let the loop (and the engine thread) run until condition() holds."""
    loop = asyncio.get_running_loop()
    end = loop.time() + TIMEOUT_S
    while not condition():
        assert loop.time() < end, "condition never held"
        await asyncio.sleep(0.001)


async def start_blocked(batcher: Batcher, in_flight: RecordingStepper) -> asyncio.Task:
    """Send a request of its own and hold the engine on its first window: everything sent next waits."""
    in_flight.hold()
    blocker = asyncio.ensure_future(batcher.embed([BLOCKER]))
    await wait_until(in_flight.entered.is_set)
    assert batcher.busy and batcher.queued_tokens == 0
    return blocker


async def queued_behind_a_blocker(batcher: Batcher, in_flight: RecordingStepper, requests) -> list:
    """Queue every request while the engine is held on a blocker, then let it go; stops the batcher and returns
    the requests' results (without the blocker's, which is answered too)."""
    blocker = await start_blocked(batcher, in_flight)
    tasks = [asyncio.ensure_future(batcher.embed(r)) for r in requests]
    await wait_until(lambda: batcher.queued_tokens == sentence_tokens(s for r in requests for s in r))
    in_flight.release()
    results = await asyncio.gather(blocker, *tasks)
    await batcher.stop()
    return results[1:]


BLOCKER = ["held", "on", "purpose"]
WORDS = ["the", "a", "cat", "dog", "sat", "on", "mat", ",", ".", "quickly", "Über", "naïve", "U.S.", "42", "bio-"]


def make_sentences(n: int, seed: int, max_len: int = 12) -> list[list[str]]:
    rng = random.Random(seed)
    return [[rng.choice(WORDS) for _ in range(rng.randint(1, max_len))] for _ in range(n)]


def sentence_tokens(sentences) -> int:
    return sum(len(s) + 2 for s in sentences)


def assert_own_rows(engine, sentences, got) -> None:
    assert len(got) == len(sentences)
    for s, layers in zip(sentences, got, strict=True):
        g, (want,) = layers.result(), engine.run([s])
        assert g.shape == want.shape == (engine.num_layers, len(s), engine.dim)
        # Alone, whole or window by window in any company: the same bits on CPU (1e-6 leaves room for a GPU).
        np.testing.assert_allclose(g, want, rtol=0, atol=1e-6)
        # with the boundary positions (/embed's `boundaries`), from a row in flight or a retry's whole run alike
        np.testing.assert_allclose(
            layers.result(boundaries=True), engine.run([s], boundaries=True)[0], rtol=0, atol=1e-6
        )


def test_every_request_gets_its_own_rows(engine):
    requests = [make_sentences(random.Random(i).randint(1, 5), seed=i) for i in range(24)]

    async def main():
        batcher, in_flight, _ = make(engine, batch_tokens=64, max_wait_s=0.002)
        # Some arrive together, some a little later: windows mix requests in every way.
        first = [asyncio.ensure_future(batcher.embed(r)) for r in requests[:12]]
        await asyncio.sleep(0)
        later = []
        for r in requests[12:]:
            later.append(asyncio.ensure_future(batcher.embed(r)))
            await asyncio.sleep(0.001)
        results = await asyncio.gather(*first, *later)
        await batcher.stop()
        return in_flight, results

    in_flight, results = run(main)
    for sentences, got in zip(requests, results, strict=True):
        assert_own_rows(engine, sentences, got)
    # Every sentence joined exactly once, and windows held several requests' sentences.
    assert sorted(map(tuple, in_flight.admitted)) == sorted(tuple(s) for r in requests for s in r)
    assert max(len({id(s) for s in w}) for w in in_flight.windows) > 1


def test_a_newcomer_joins_sentences_in_flight_and_leaves_before_them(engine):
    long, other, short = ["long"] * 30, ["other"] * 30, ["short", "one"]  # 32 positions: 8 windows of 4

    async def main():
        batcher, in_flight, _ = make(engine, window=4, max_wait_s=0.5)  # the two long ones start together
        in_flight.hold()
        first = [asyncio.ensure_future(batcher.embed([s])) for s in (long, other)]
        await wait_until(in_flight.entered.is_set)  # the long ones are in their first window
        second = asyncio.ensure_future(batcher.embed([short]))
        await wait_until(lambda: batcher.queued_tokens == 4)
        in_flight.hold_at = 3  # the long ones wait in their third window until the short one is answered
        in_flight.release()
        got_short = await second
        await wait_until(lambda: len(in_flight.windows) == 3)
        assert not any(f.done() for f in first)  # answered while the long ones are still computing
        in_flight.release()
        got_long = await asyncio.gather(*first)
        await batcher.stop()
        return in_flight, got_long, got_short

    in_flight, got_long, got_short = run(main)
    assert in_flight.windows[:2] == [[long, other], [long, other, short]]  # joined at the next window
    assert all(w == [long, other] for w in in_flight.windows[2:]) and len(in_flight.windows) == 8
    assert_own_rows(engine, [long, other], [g[0] for g in got_long])
    assert_own_rows(engine, [short], got_short)


def test_a_lone_sentence_with_no_one_waiting_runs_to_its_end_in_one_call(engine):
    long = ["long"] * 30

    async def main():
        batcher, in_flight, _ = make(engine, window=4)
        got = await batcher.embed([long])
        await batcher.stop()
        return in_flight, got

    in_flight, got = run(main)
    assert in_flight.windows == [[long]]
    assert_own_rows(engine, [long], got)


def test_on_the_window_graph_every_call_is_its_window_and_the_stats_count_what_ran(tiny_model_dir, engine):
    from service.engine.session import Engine

    window_engine = Engine(tiny_model_dir, provider="cpu", graph="window")
    long, short = ["long"] * 70, ["short"] * 3  # 72 positions: 3 windows of 32; 5 positions
    stats: list[BatchStats] = []

    async def main():
        batcher, in_flight, _ = make(window_engine, window=4, stats=stats)
        got = await asyncio.gather(batcher.embed([long]), batcher.embed([short]))
        await batcher.stop()
        return in_flight, got

    in_flight, (got_long, got_short) = run(main)
    assert in_flight.lengths == [32, 32, 32]  # not the lone sentence's 72, nor an early end at the short one's 5
    # each call computes its rows (a multiple of 2 on the CPU) times the window, whatever is real
    assert [(s.sentences, s.real_tokens, s.padded_tokens) for s in stats] == [(2, 37, 64), (1, 32, 64), (1, 8, 64)]
    assert_own_rows(engine, [long], got_long)  # the Loop graph's numbers, within 1e-6
    assert_own_rows(engine, [short], got_short)


def test_a_window_ends_early_where_a_sentence_ends_so_its_slot_refills(engine):
    five, long = ["five", "tokens", "in", "this", "one"], ["long"] * 20  # 7 and 22 positions

    async def main():
        batcher, in_flight, _ = make(engine, window=4, max_wait_s=0.5)  # both start together
        got = await asyncio.gather(batcher.embed([five]), batcher.embed([long]))
        await batcher.stop()
        return in_flight, got

    in_flight, (got_five, got_long) = run(main)
    # 4 positions, then the 3 left of the short one (at least half a window), then the long one alone runs to its end.
    assert in_flight.lengths == [4, 3, 15] and in_flight.windows == [[five, long], [five, long], [long]]
    assert_own_rows(engine, [five], got_five)
    assert_own_rows(engine, [long], got_long)


def test_sentences_in_flight_stay_within_the_token_budget_and_join_in_order(engine):
    batch_tokens = 40
    requests = [make_sentences(3, seed=100 + i, max_len=15) for i in range(10)]
    requests.append([["long"] * 45])  # alone over the budget: it runs once nothing else is in flight
    stats: list[BatchStats] = []

    async def main():
        batcher, in_flight, _ = make(engine, batch_tokens=batch_tokens, stats=stats)
        return in_flight, await queued_behind_a_blocker(batcher, in_flight, requests)

    in_flight, results = run(main)
    for sentences, got in zip(requests, results, strict=True):
        assert_own_rows(engine, sentences, got)
    for window in in_flight.windows:
        assert sentence_tokens(window) <= batch_tokens or len(window) == 1, window
    assert [["long"] * 45] in in_flight.windows  # ran alone
    assert in_flight.admitted == [BLOCKER] + [s for r in requests for s in r]  # in the order they came
    # The metrics hook sees every window: its rows and the positions it computed.
    assert [s.sentences for s in stats] == [len(w) for w in in_flight.windows]
    assert sum(s.real_tokens for s in stats) == sentence_tokens([BLOCKER] + [s for r in requests for s in r])


def test_a_request_larger_than_the_budget_is_spread_and_answered_in_order(engine):
    sentences = make_sentences(30, seed=7, max_len=10)

    async def main():
        batcher, in_flight, _ = make(engine, batch_tokens=24)
        got = await batcher.embed(sentences)
        await batcher.stop()
        return in_flight, got

    in_flight, got = run(main)
    assert max(len(w) for w in in_flight.windows) < len(sentences)
    assert in_flight.admitted == sentences
    assert_own_rows(engine, sentences, got)  # in the request's order, not the order they finished


def test_an_idle_engine_waits_for_company_until_the_budget_is_full(engine):
    a, b = [["one", "two", "three", "four"]], [["five", "six", "seven", "eight"]]

    async def main():
        batcher, in_flight, _ = make(engine, batch_tokens=2 * 6, max_wait_s=TIMEOUT_S)
        first = asyncio.ensure_future(batcher.embed(a))
        await wait_until(lambda: batcher.queued_tokens == 6)
        for _ in range(20):
            await asyncio.sleep(0)
        assert in_flight.windows == [] and not first.done()  # still waiting for company
        results = await asyncio.gather(first, batcher.embed(b))
        await batcher.stop()
        return in_flight, results

    in_flight, (got_a, got_b) = run(main)
    assert in_flight.windows[0] == a + b
    assert_own_rows(engine, a, got_a)
    assert_own_rows(engine, b, got_b)


def test_a_lone_request_goes_when_max_wait_is_over(engine):
    async def main():
        batcher, in_flight, _ = make(engine, batch_tokens=100_000, max_wait_s=0.01)
        got = await batcher.embed([["alone"]])
        again = await batcher.embed([["again", "alone"]])
        await batcher.stop()
        return in_flight, got, again

    in_flight, got, again = run(main)
    assert in_flight.admitted == [["alone"], ["again", "alone"]]
    assert_own_rows(engine, [["alone"]], got)
    assert_own_rows(engine, [["again", "alone"]], again)


def test_queue_full_is_raised_at_once_and_clears_after_draining(engine):
    eight = ["w"] * 8  # 10 tokens with its boundaries

    async def main():
        batcher, in_flight, _ = make(engine, queue_tokens=20)
        blocker = await start_blocked(batcher, in_flight)
        first = asyncio.ensure_future(batcher.embed([eight]))
        second = asyncio.ensure_future(batcher.embed([eight]))
        await wait_until(lambda: batcher.queued_tokens == 20)  # exactly full is still accepted
        with pytest.raises(QueueFull):
            await batcher.embed([["x"]])
        with pytest.raises(LargerThanQueue, match=r"21 tokens .* the limit is 20"):
            await batcher.embed([["x"] * 19])  # would never fit, even in an empty queue: no use retrying
        # Refused at once: the engine is still held, nothing was added, nothing else ran.
        assert len(in_flight.windows) == 1 and batcher.queued_tokens == 20
        in_flight.release()
        results = await asyncio.gather(blocker, first, second)
        assert batcher.queued_tokens == 0
        again = await batcher.embed([["x"], eight])  # 13 tokens: accepted now
        await batcher.stop()
        return in_flight, results, again

    in_flight, results, again = run(main)
    assert_own_rows(engine, [eight], results[1])
    assert_own_rows(engine, [eight], results[2])
    assert_own_rows(engine, [["x"], eight], again)
    assert ["x"] * 19 not in in_flight.admitted


def test_a_cancelled_request_never_reaches_the_engine(engine):
    gone, stays = ["client", "went", "away"], ["still", "here"]

    async def main():
        batcher, in_flight, _ = make(engine, queue_tokens=1000)
        blocker = await start_blocked(batcher, in_flight)
        cancelled = asyncio.ensure_future(batcher.embed([gone, gone]))
        kept = asyncio.ensure_future(batcher.embed([stays]))
        await wait_until(lambda: batcher.queued_tokens == 2 * 5 + 4)
        cancelled.cancel()
        await asyncio.gather(cancelled, return_exceptions=True)
        assert cancelled.cancelled()
        assert batcher.queued_tokens == 4  # its tokens left the queue with it
        in_flight.release()
        await asyncio.gather(blocker, kept)
        await batcher.stop()
        return in_flight, kept.result()

    in_flight, kept = run(main)
    assert gone not in in_flight.admitted
    assert in_flight.admitted == [BLOCKER, stays]
    assert_own_rows(engine, [stays], kept)


def test_a_request_cancelled_in_flight_is_dropped_before_the_next_window(engine):
    leaves, stays = ["a"] * 20, ["b"] * 20  # 22 positions: 6 windows of 4

    async def main():
        batcher, in_flight, _ = make(engine, window=4)
        in_flight.hold()
        gone = asyncio.ensure_future(batcher.embed([leaves]))
        kept = asyncio.ensure_future(batcher.embed([stays]))
        await wait_until(lambda: len(in_flight.windows) == 1)  # both in their first window
        gone.cancel()
        await asyncio.gather(gone, return_exceptions=True)
        in_flight.release()
        got = await kept
        await batcher.stop()
        return in_flight, got, gone

    in_flight, got, gone = run(main)
    assert gone.cancelled()
    assert in_flight.windows[0] == [leaves, stays] and all(w == [stays] for w in in_flight.windows[1:])
    assert_own_rows(engine, [stays], got)


def test_a_failed_window_is_run_again_in_halves_and_only_the_failing_sentence_fails(engine):
    poisoned, neighbour, fine = ["BOOM", "x"], ["y", "z"], ["fine"] * 3

    async def main():
        batcher, in_flight, retries = make(engine, poison="BOOM")
        blocker = await start_blocked(batcher, in_flight)
        tasks = [asyncio.ensure_future(batcher.embed(r)) for r in ([poisoned], [neighbour], [fine, poisoned])]
        await wait_until(lambda: batcher.queued_tokens == 4 + 4 + 5 + 4)
        in_flight.release()
        results = await asyncio.gather(blocker, *tasks, return_exceptions=True)
        after = await batcher.embed([neighbour, fine])  # still serving
        await batcher.stop()
        return retries, results, after

    retries, (r_blocker, r_poisoned, r_neighbour, r_mixed), after = run(main)
    assert isinstance(r_poisoned, EngineFailure)
    assert isinstance(r_mixed, EngineFailure)  # its other sentence was fine, this one was not
    assert_own_rows(engine, [BLOCKER], r_blocker)  # in flight with the poison: answered from a retry
    assert_own_rows(engine, [neighbour], r_neighbour)
    assert_own_rows(engine, [neighbour, fine], after)
    assert [poisoned] in retries.calls  # the poisoned sentence failed alone
    assert all(len(call) == 1 or any("BOOM" in s for s in call) for call in retries.calls if len(call) > 1)


def test_an_out_of_memory_window_is_answered_in_smaller_batches(engine):
    requests = [make_sentences(3, seed=400 + i, max_len=6) for i in range(5)]

    async def main():
        batcher, in_flight, retries = make(engine, max_rows=3)
        return retries, await queued_behind_a_blocker(batcher, in_flight, requests)

    retries, results = run(main)
    for sentences, got in zip(requests, results, strict=True):
        assert_own_rows(engine, sentences, got)
    worked = [call for call in retries.calls if len(call) <= 3]
    assert retries.calls[0] == sorted(retries.calls[0], key=len, reverse=True) and len(retries.calls[0]) == 15
    assert sum(map(len, worked)) == 15  # every sentence in flight ran once in a batch that worked


def test_stop_finishes_queued_work_first(engine):
    requests = [make_sentences(2, seed=300 + i) for i in range(6)]
    order: list[str] = []

    async def request(batcher, i):
        result = await batcher.embed(requests[i])
        order.append(f"request {i}")
        return result

    async def main():
        batcher, in_flight, _ = make(engine, batch_tokens=32)
        blocker = await start_blocked(batcher, in_flight)
        tasks = [asyncio.ensure_future(request(batcher, i)) for i in range(len(requests))]
        await wait_until(lambda: batcher.queued_tokens == sentence_tokens(s for r in requests for s in r))
        stopping = asyncio.ensure_future(batcher.stop())
        for _ in range(20):
            await asyncio.sleep(0)
        assert not stopping.done()  # it cannot be done while work is queued
        in_flight.release()
        await stopping
        order.append("stopped")
        await blocker
        return await asyncio.gather(*tasks)

    results = run(main)
    assert order[-1] == "stopped" and sorted(order[:-1]) == sorted(f"request {i}" for i in range(len(requests)))
    for sentences, got in zip(requests, results, strict=True):
        assert_own_rows(engine, sentences, got)


def test_an_empty_request_is_answered_at_once(engine):
    async def main():
        batcher, in_flight, _ = make(engine, queue_tokens=100)
        got = await batcher.embed([])
        after = await batcher.embed([["ok"]])
        await batcher.stop()
        return in_flight, got, after

    in_flight, got, after = run(main)
    assert got == []
    assert in_flight.admitted == [["ok"]]
    assert_own_rows(engine, [["ok"]], after)


class AdmitFails(RecordingStepper):
    """A in_flight that cannot take a sentence holding "HUGE" in (like running out of memory for its buffers)."""

    def admit(self, sentences, tags) -> None:
        if any("HUGE" in s for s in sentences):
            raise MemoryError("cannot allocate the sentence's buffers")
        super().admit(sentences, tags)


def test_a_failure_while_sentences_join_runs_them_and_those_in_flight_again_whole(engine):
    huge, other, another = ["HUGE", "one"], ["in", "flight", "already"] * 4, ["also", "in", "flight"] * 4

    async def main():
        in_flight = AdmitFails(engine, window=4)
        retries = RecordingRun(engine)
        batcher = Batcher(retries, in_flight, 4096, 0.5, 100_000)
        batcher.start()
        in_flight.hold()
        first = [asyncio.ensure_future(batcher.embed([s])) for s in (other, another)]  # start together
        await wait_until(in_flight.entered.is_set)
        second = asyncio.ensure_future(batcher.embed([huge]))
        await wait_until(lambda: batcher.queued_tokens == 4)
        in_flight.release()
        got = await asyncio.gather(*first, second)
        after = await batcher.embed([["still", "serving"]])  # the engine thread lives on
        await batcher.stop()
        return retries, got, after

    retries, (got_other, got_another, got_huge), after = run(main)
    assert retries.calls == [[other, another, huge]]  # in flight and joining: run again whole, longest first
    assert_own_rows(engine, [other], got_other)
    assert_own_rows(engine, [another], got_another)
    assert_own_rows(engine, [huge], got_huge)
    assert_own_rows(engine, [["still", "serving"]], after)


def test_clients_take_turns(engine):
    # Client a queues two requests of 6 sentences, then b one of 2, then c one: they join a sentence of each
    # client at a time, so b's and c's are not behind all of a's; each client's sentences keep their order.
    a1, a2 = make_sentences(6, seed=1), make_sentences(6, seed=2)
    b, c = make_sentences(2, seed=3), make_sentences(1, seed=4)

    async def main():
        batcher, in_flight, _ = make(engine, batch_tokens=10_000)
        blocker = await start_blocked(batcher, in_flight)
        tasks = [asyncio.ensure_future(batcher.embed(r, client)) for r, client in ((a1, "a"), (a2, "a"), (b, "b"),
                                                                                   (c, "c"))]  # fmt: skip
        await wait_until(lambda: batcher.queued_tokens == sentence_tokens([*a1, *a2, *b, *c]))
        in_flight.release()
        results = await asyncio.gather(blocker, *tasks)
        await batcher.stop()
        return in_flight, results[1:]

    in_flight, results = run(main)
    for sentences, got in zip((a1, a2, b, c), results, strict=True):
        assert_own_rows(engine, sentences, got)
    a = [*a1, *a2]
    assert in_flight.admitted == [BLOCKER, a[0], b[0], c[0], a[1], b[1], *a[2:]]


def test_a_full_queue_is_shared_a_flood_gets_its_own_503s(engine):
    # The queue holds 40 tokens; client a fills it with four requests of 10 tokens. b's request, within its share
    # (half, with two clients waiting), pushes out a's newest one, which gets the QueueFull instead; a, over its
    # share, is refused itself; c then takes a's next newest. Each answered request still gets its own rows.
    eight = ["w"] * 8  # 10 tokens with its boundaries
    mine = [[*eight[:7], f"a{k}"] for k in range(4)]

    async def main():
        batcher, in_flight, _ = make(engine, queue_tokens=40)
        blocker = await start_blocked(batcher, in_flight)
        a = [asyncio.ensure_future(batcher.embed([s], "a")) for s in mine]
        await wait_until(lambda: batcher.queued_tokens == 40)
        b = asyncio.ensure_future(batcher.embed([["b"] * 8], "b"))
        await wait_until(lambda: a[3].done())
        with pytest.raises(QueueFull, match=r"queue holds 40 of 40 tokens: your address held more than its share"):
            a[3].result()
        with pytest.raises(QueueFull, match=r"30 of them from your address, whose share is 20 now"):
            await batcher.embed([["again"]], "a")
        c = asyncio.ensure_future(batcher.embed([["c"] * 3], "c"))  # 5 tokens, within a third
        await wait_until(lambda: a[2].done())
        with pytest.raises(QueueFull):
            a[2].result()
        assert batcher.queued_tokens == 35 and len(in_flight.windows) == 1  # refused at once: nothing else ran
        in_flight.release()
        results = await asyncio.gather(blocker, a[0], a[1], b, c)
        await batcher.stop()
        return results[1:]

    a0, a1, b, c = run(main)
    assert_own_rows(engine, mine[:2], [*a0, *a1])
    assert_own_rows(engine, [["b"] * 8], b)
    assert_own_rows(engine, [["c"] * 3], c)
