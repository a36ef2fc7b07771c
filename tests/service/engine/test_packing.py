"""Packed rows on the window graph: sentences one after another in a row, started where the last one ended, get
the bits of a sentence run alone; rows are refilled as sentences finish and dropped when nothing is left; and the
positions computed are mostly the sentences' own."""

from __future__ import annotations

import random
import sys

import numpy as np
import pytest

from service.engine.packing import PackedRows, finite_rows
from service.engine.session import ROW_MULTIPLE, Engine

WINDOW = 32


@pytest.fixture(scope="module")
def window_engine(tiny_model_dir) -> Engine:
    return Engine(tiny_model_dir, provider="cpu", graph="window", intra_op_threads=2)


def run_packed(packed: PackedRows, sentences: list[list[str]], per_call: int, seed: int) -> dict[int, np.ndarray]:
    """Sentences join up to `per_call` at a time between calls, in random groups; each one's result by index."""
    rng, waiting, results = random.Random(seed), list(range(len(sentences))), {}
    while waiting or packed.busy:
        k = rng.randint(0, per_call)
        packed.admit([sentences[i] for i in waiting[:k]], waiting[:k])
        waiting = waiting[k:]
        results.update((s.tag, s.result()) for s in packed.step())
    return results


def test_a_sentence_packed_anywhere_in_a_row_is_the_bits_of_it_alone(window_engine, sentences):
    alone = [window_engine.run([s])[0] for s in sentences]
    for per_call, seed in ((1, 0), (3, 1), (30, 2)):
        got = run_packed(PackedRows(window_engine), sentences, per_call, seed)
        for i, want in enumerate(alone):
            np.testing.assert_array_equal(got[i], want)


def test_rows_hold_several_sentences_and_continue_across_calls(window_engine):
    packed = PackedRows(window_engine)
    short, long = ["a"] * 8, ["b"] * 60  # 10 and 62 positions
    packed.admit([short, short, long], ["s1", "s2", "long"])
    rows, source = packed.plan()
    assert [[(s.tag, first, n) for s, first, n in row] for row in rows] == [
        [("s1", 0, 10), ("s2", 0, 10), ("long", 0, 12)]  # one row: three sentences, the last continues
    ]
    finished = packed.step()
    assert sorted(s.tag for s in finished) == ["s1", "s2"]
    rows, source = packed.plan()
    assert [[(s.tag, first, n) for s, first, n in row] for row in rows] == [[("long", 12, 32)]] and source == [0]
    packed.step()
    assert [s.tag for s in packed.step()] == ["long"] and not packed.busy


def test_rows_are_refilled_as_sentences_end_and_dropped_when_nothing_is_left(window_engine):
    packed = PackedRows(window_engine, max_rows=2)
    packed.admit([["x"] * 40, ["y"] * 5, ["z"] * 5, ["w"] * 5], range(4))
    rows, _ = packed.plan()
    assert [[s.tag for s, _, _ in row] for row in rows] == [[0], [1, 2, 3]]  # at most two rows
    packed.step()
    rows, source = packed.plan()
    assert [[s.tag for s, _, _ in row] for row in rows] == [[0]] and source == [0]  # row 1 had nothing left


def test_sentences_whose_client_left_are_dropped_and_their_row_refilled(window_engine):
    packed = PackedRows(window_engine)
    packed.admit([["a"] * 50, ["b"] * 3], ["gone", "stays"])
    packed.step()  # "gone" continues in row 0
    packed.admit([["c"] * 4], ["new"])
    assert [s.tag for s in packed.drop(lambda s: s.tag == "gone")] == ["gone"]
    rows, source = packed.plan()
    assert [[(s.tag, first) for s, first, _ in row] for row in rows] == [[("new", 0)]] and source == [0]
    assert [s.tag for s in packed.step()] == ["new"]


def test_padding_efficiency_counts_every_position_computed(window_engine):
    packed = PackedRows(window_engine)
    packed.admit([["a"] * 8], [0])  # 10 positions in one row, fed as ROW_MULTIPLE rows of WINDOW
    packed.step()
    assert (packed.positions, packed.computed) == (10, ROW_MULTIPLE * WINDOW)
    assert packed.efficiency == pytest.approx(10 / (ROW_MULTIPLE * WINDOW))


def test_a_steady_stream_keeps_rows_full(window_engine):
    """Rows refilled as sentences end: over 2,000 sentences of a long-tailed mix at 64 rows, nearly every position
    computed is a sentence's (bench/gpu.py measures it on the fixture and the same mix at 256 and 1024 rows)."""
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(np.log(18), 0.8, 2000).astype(int), 1, 250)
    sentences = [["w"] * int(n) for n in lengths]
    packed, fed = PackedRows(window_engine, max_rows=64), iter(range(len(sentences)))
    while True:  # more waiting than a call can start, as the batcher keeps it (within its token budget)
        while len(packed.waiting) < 3 * 64 and (i := next(fed, None)) is not None:
            packed.admit([sentences[i]], [i])
        if not packed.busy:
            break
        packed.step()
    assert packed.positions == int(lengths.sum()) + 2 * len(sentences)
    assert packed.efficiency >= 0.9


def test_finite_batches_pack_into_few_full_rows_with_the_bits_of_each_sentence_alone(window_engine, sentences):
    # engine.run sizes its rows for about FINITE_CALLS calls, longest sentences first: most positions computed are
    # the sentences' own (0.51 at 32 sentences with a row per sentence), and the numbers are the same bits.
    many = [sentences[i % len(sentences)] for i in range(64)]
    got = window_engine.run(many)
    assert window_engine.run_efficiency >= 0.85
    for s, layers in zip(many[:30], got[:30], strict=True):
        np.testing.assert_array_equal(layers, window_engine.run([s])[0])
    # one sentence: on ROW_MULTIPLE rows (2 on the CPU, where one row's products round otherwise; 1 on CUDA)
    window_engine.run([["a"] * 8])
    assert window_engine.run_efficiency == pytest.approx(10 / (ROW_MULTIPLE * WINDOW))


def test_finite_rows_are_sized_for_few_calls():
    assert finite_rows(10, WINDOW, 2, 1024) == 2  # one sentence: the fewest rows a call is fed as
    assert finite_rows(10, WINDOW, 1, 1024) == 1
    assert finite_rows(1000, WINDOW, 2, 1024) == 4  # 1000 / (32 * 8) = 3.9 rows
    assert finite_rows(10**6, WINDOW, 2, 1024) == 1024  # at most max_rows


def test_the_output_blocks_are_reused_and_never_while_a_sentence_views_them(window_engine, sentences):
    # Each call's layers are written into a pooled block that the sentences keep views of; a block is lent again
    # only once no view of it is alive, so results kept across many later calls stay intact.
    kept = PackedRows(window_engine)
    kept.admit(sentences[:4], range(4))
    held = []
    while kept.busy:
        held += kept.step()  # finished, not put together yet: their views hold their calls' blocks
    pool = window_engine._window.pool
    made = pool.allocated
    for _ in range(6):  # later calls: none may write into the blocks the held sentences view
        window_engine.run(sentences)
    for s in held:
        np.testing.assert_array_equal(s.result(), window_engine.run([sentences[s.tag]])[0])
    # steady state: the same few blocks lent again (a run's calls free theirs as their sentences are put together)
    before = pool.allocated
    for _ in range(4):
        window_engine.run(sentences)
    assert pool.allocated == before and pool.allocated - made <= 3


def test_the_next_calls_feeds_built_during_a_call_change_no_bit(window_engine, sentences):
    # prefetch: call N+1 planned and its feeds built on another thread while call N runs (before N's new tokens
    # reach the cache: they are encoded again, the same bits); sentences admitted between steps join later calls
    alone = [window_engine.run([s])[0] for s in sentences]
    ahead = PackedRows(window_engine, max_rows=4, prefetch=True)
    got, fed = {}, 0
    while fed < len(sentences) or ahead.busy:
        ahead.admit(sentences[fed : fed + 3], range(fed, min(fed + 3, len(sentences))))
        fed += 3
        for s in ahead.step():
            assert s.tag not in got  # each sentence finished once
            got[s.tag] = s.result()
    assert sorted(got) == list(range(len(sentences))) and ahead.prepare_s > 0
    for i, want in enumerate(alone):
        np.testing.assert_array_equal(got[i], want)


class FailingEngine:
    """The real window engine, whose `fail_at`-th call (`run_prepared`) or `fail_at`-th feeds built
    (`prepare_packed`, on the preparing thread while a call runs) raise, as a device error or a bug would."""

    def __init__(self, engine: Engine, where: str, fail_at: int):
        self.engine, self.where, self.fail_at, self.counts = engine, where, fail_at, {"run": 0, "prepare": 0}

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def _count(self, where: str) -> None:
        self.counts[where] += 1
        if where == self.where and self.counts[where] == self.fail_at:
            raise RuntimeError(f"{where} {self.fail_at} failed")

    def prepare_packed(self, rows, source):
        self._count("prepare")
        return self.engine.prepare_packed(rows, source)

    def run_prepared(self, prepared):
        self._count("run")
        return self.engine.run_prepared(prepared)


@pytest.mark.parametrize(("where", "fail_at"), [("run", 1), ("run", 2), ("run", 4), ("prepare", 2), ("prepare", 3)])
def test_a_failed_call_with_prefetch_hands_back_every_sentence_it_did_not_finish(window_engine, sentences, where,
                                                                                 fail_at):  # fmt: skip
    # With prefetch the bookkeeping runs a call ahead: the sentences the failed call was to finish are in no row and
    # no longer waiting. They are handed back by clear(), with every other unfinished one, and none is answered.
    many = [sentences[i % len(sentences)] for i in range(3 * len(sentences))]
    alone = [window_engine.run([s])[0] for s in sentences]
    failing = FailingEngine(window_engine, where, fail_at)
    packed = PackedRows(failing, max_rows=2, prefetch=True)
    packed.admit(many, range(len(many)))
    got = {}
    with pytest.raises(RuntimeError, match=f"{where} {fail_at} failed") as raised:
        while packed.busy:
            got.update((s.tag, s.result()) for s in packed.step())
    if where == "run" and sys.version_info >= (3, 11):  # notes from 3.11 on
        assert "handed back by clear()" in raised.value.__notes__[0]
    back = sorted(s.tag for s in packed.clear())
    assert not packed.busy and back and not set(back) & set(got)
    assert sorted([*got, *back]) == list(range(len(many)))  # none lost, none twice
    # what was answered before the failure is each sentence's own; the handed-back ones run again on the same rows
    failing.where = None
    packed.admit([many[i] for i in back], back)
    while packed.busy:
        for s in packed.step():
            assert s.tag not in got
            got[s.tag] = s.result()
    assert sorted(got) == list(range(len(many)))
    for i, layers in got.items():
        np.testing.assert_allclose(layers, alone[i % len(sentences)], rtol=0, atol=1e-5)
