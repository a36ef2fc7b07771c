"""Continuous batching's in_flight: sentences run window by window, joining and leaving between windows, get
exactly the bits of a whole run, on the tiny fixture and on a model wide enough that ONNX Runtime splits its
products into blocks (512-term dot products, as in the full-size model)."""

from __future__ import annotations

import json
import random
import shutil

import numpy as np
import pytest

from model_export.export import export_model
from model_export.options import BiLMOptions
from model_export.weights import random_bilm
from service.batching.in_flight import InFlight
from service.engine.session import Engine


@pytest.fixture(scope="module")
def wide_engine(tmp_path_factory) -> Engine:
    """A random biLM with the full-size model's projection (512) and a small char-CNN, exported as
    elmo-export does."""
    opt = BiLMOptions.from_dict(
        {
            "lstm": {"n_layers": 2, "projection_dim": 512, "dim": 1024, "cell_clip": 3, "proj_clip": 3,
                     "use_skip_connections": True},
            "char_cnn": {"embedding": {"dim": 4}, "filters": [[1, 8], [2, 8], [3, 16]], "n_highway": 1,
                         "n_characters": 262, "max_characters_per_token": 50, "activation": "relu"},
        }
    )  # fmt: skip
    out = tmp_path_factory.mktemp("wide-onnx")
    export_model(random_bilm(opt, seed=3), out)
    return Engine(out, provider="cpu", intra_op_threads=2)


def staggered(in_flight: InFlight, sentences: list[list[str]], seed: int) -> tuple[dict[int, np.ndarray], int]:
    """Sentences join 0 to 3 at a time between windows, at random; each one's result by index, and the
    number of windows run."""
    rng = random.Random(seed)
    waiting, results, windows = list(range(len(sentences))), {}, 0
    while waiting or in_flight.rows:
        k = rng.randint(0, 3)
        in_flight.admit([sentences[i] for i in waiting[:k]], waiting[:k])
        waiting = waiting[k:]
        if in_flight.rows:
            results.update((row.tag, row.result()) for row in in_flight.step())
            windows += 1
    return results, windows


@pytest.mark.parametrize("which", ["tiny", "wide"])
@pytest.mark.parametrize("window", [1, 3, 8, 100])
def test_window_by_window_is_bit_identical_to_a_whole_run(which, window, engine, wide_engine, sentences):
    engine = engine if which == "tiny" else wide_engine
    want = engine.run(sentences)
    got, windows = staggered(InFlight(engine, window), sentences, seed=window)
    longest = max(map(len, sentences)) + 2
    assert windows >= -(-longest // window)  # the longest sentence took that many windows at least
    assert sorted(got) == list(range(len(sentences)))
    for i, w in enumerate(want):
        np.testing.assert_array_equal(got[i], w)


def test_rows_leave_as_they_finish_and_layer_zero_is_the_token_twice(engine, sentences):
    in_flight = InFlight(engine, window=4)
    short, long = ["a", "b"], sentences[0]  # 4 positions with boundaries: one window
    in_flight.admit([short, long], ["short", "long"])
    (first,) = in_flight.step()
    assert first.tag == "short" and [row.tag for row in in_flight.rows] == ["long"]
    result = first.result()
    assert result.shape == (engine.num_layers, 2, engine.dim)
    half = engine.dim // 2
    np.testing.assert_array_equal(result[0, :, :half], result[0, :, half:])


def test_dropped_and_cleared_rows_leave_the_others_exact(engine, sentences):
    want = engine.run(sentences[:6])
    in_flight = InFlight(engine, window=2)
    in_flight.admit(sentences[:6], range(6))
    in_flight.step()
    gone = in_flight.drop(lambda row: row.tag % 2 == 1)  # clients 1, 3 and 5 left
    assert sorted(row.tag for row in gone) == [1, 3, 5] and len(in_flight.rows) == 3
    results = {}
    while in_flight.rows:
        results.update((row.tag, row.result()) for row in in_flight.step())
    assert sorted(results) == [0, 2, 4]
    for i, got in results.items():
        np.testing.assert_array_equal(got, want[i])
    in_flight.admit(sentences[:2], [0, 1])
    in_flight.step()
    assert len(in_flight.clear()) == 2 and in_flight.rows == []
    again, _ = staggered(in_flight, sentences[:2], seed=0)  # a cleared in_flight starts afresh
    np.testing.assert_array_equal(again[1], want[1])


def test_an_export_from_before_windows_is_refused_with_a_clear_message(tiny_model_dir, tmp_path):
    old = tmp_path / "old"
    shutil.copytree(tiny_model_dir, old)
    manifest = json.loads((old / "manifest.json").read_text())
    manifest["graph_version"] = 4
    (old / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match=r"graph version 4.*export it again"):
        Engine(old, provider="cpu")
