"""bench/common.py's export cache: a benchmark must measure the graphs an export writes today, never a folder
left by an older exporter (CI once failed because a cached export predated the int8 graph); and the turns in
which every benchmark runs its engines."""

from __future__ import annotations

import json
import time

from bench import common
from model_export.export import graph_list


def test_cached_export_is_reused_and_an_older_one_written_again(tmp_path, monkeypatch):
    monkeypatch.setattr(common, "BUILD", tmp_path)
    out = common.tiny_model()
    files = {g["file"] for g in graph_list()}
    assert files <= {p.name for p in out.iterdir()}
    written = (out / "manifest.json").stat().st_mtime_ns

    assert common.tiny_model() == out
    assert (out / "manifest.json").stat().st_mtime_ns == written  # same graphs: reused, not exported again

    manifest = json.loads((out / "manifest.json").read_text())  # as an export from before the int8 graph
    manifest["graphs"] = [g for g in manifest["graphs"] if g["precision"] != "int8"]
    (out / "manifest.json").write_text(json.dumps(manifest))
    (out / "model_int8.onnx").unlink()

    common.tiny_model()
    again = json.loads((out / "manifest.json").read_text())
    assert [g["file"] for g in again["graphs"]] == [g["file"] for g in graph_list()]
    assert (out / "model_int8.onnx").exists()


def test_in_turn_runs_every_batch_by_each_in_turn_for_rounds_or_seconds():
    calls = []
    runs = {name: (lambda batch, name=name: calls.append((name, len(batch)))) for name in ("a", "b")}
    batches = [[["x"]] * 2, [["x", "y"]] * 3]  # 2 and 6 tokens

    rates = common.in_turn(runs, batches, rounds=2)
    assert calls[:2] == [("a", 2), ("b", 2)]  # one warm-up batch each, then each batch by a and b in turn
    assert calls[2:] == [("a", 2), ("b", 2), ("a", 3), ("b", 3)] * 2
    assert set(rates) == {"a", "b"} and all(rate > 0 for rate in rates.values())

    slow = {"slow": lambda batch: time.sleep(0.01)}
    start = time.perf_counter()
    common.in_turn(slow, batches, seconds=0.1)
    assert time.perf_counter() - start >= 0.1  # passes repeat until the run has had its seconds
