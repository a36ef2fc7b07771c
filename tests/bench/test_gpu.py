"""bench.gpu on the CPU provider and the tiny fixture model: the GPU benchmark runs end to end, so it cannot rot
before a GPU session runs it, and its figures are real numbers (parity, independence, speed, placement)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench-gpu")
    command = [sys.executable, "-m", "bench.gpu", "--provider", "cpu", "--model", "tiny", "--batches", "1,4",
               "--seconds", "0.2", "--precisions", "fp32,fp16", "--cuda-graphs", "off,on", "--no-torch",
               "--threads", "1", "--rows", "8,16", "--bulk-sentences", "120", "--clients", "",
               "--out", str(out)]  # fmt: skip
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return out, json.loads((out / "gpu.json").read_text()), done.stdout


def test_report_says_what_ran_where(run):
    _, report, _ = run
    assert report["device"] == "cpu" and report["provider"] == "cpu"
    assert report["onnxruntime"] and report["date"]
    assert report["model"]["name"] == "tiny" and report["model"]["output_dim"] == 32
    assert set(report["engines"]) == {f"{p}, cuda graphs {g}" for p in ("fp32", "fp16") for g in ("off", "on")}
    assert report["baselines"] == {} and "yardstick" not in report
    assert any("PyTorch baseline and yardstick skipped" in note for note in report["notes"])
    assert any("allennlp baseline skipped" in note for note in report["notes"])


def test_placement_on_the_cpu_has_no_copies_and_no_node_elsewhere(run):
    _, report, _ = run
    placement = report["placement"]
    # every graph of the export, the CPU-only int8 one included (on CUDA it is left out: the engine refuses it there)
    assert set(placement) == {"model.onnx", "model_int8.onnx", "model_window.onnx", "model_window_fp16.onnx",
                              "model_int8_vnni.onnx"}  # fmt: skip
    for graph in placement.values():
        assert graph["memcpy_to_host"] == 0 and graph["memcpy_from_host"] == 0
        assert graph["nodes_off_provider"] == 0 and graph["off_provider"] == []
        assert graph["nodes"] > 10 and graph["provider"] == "CPUExecutionProvider" and "error" not in graph
    # the window graph's LSTM nodes per position (both layers, both directions at once): 2 layers x 18 or 19
    assert 30 <= placement["model_window.onnx"]["nodes_per_window_step"] <= 40
    assert placement["model.onnx"]["nodes_per_window_step"] is None


def test_parity_and_batch_independence(run):
    _, report, _ = run
    for name, engine in report["engines"].items():
        assert "error" not in engine, name
        assert engine["graph"]["kind"] == "window" and engine["graph"]["window"] == 32
        assert engine["provider"] == "CPUExecutionProvider"
        parity = engine["parity_vs_cpu_fp32"]
        if engine["precision"] == "fp32":
            assert parity["max_abs_error"] <= 1e-5, name
        else:
            assert 0 < parity["max_abs_error"] < 0.05, name  # fp16 products: measurably, not grossly, off
        assert parity["min_cosine"] >= 0.999, name
        independence = engine["batch_independence"]
        assert set(independence) == {"batch_30", "batch_256", "max_abs_diff"}
        assert independence["max_abs_diff"] <= 1e-5, name


def test_speed_figures_are_real_numbers(run):
    _, report, _ = run
    for engine in report["engines"].values():
        rates = engine["tokens_per_s"]
        assert set(rates["fixture"]) == {"1", "4"} and set(rates["sorted"]) == {"4"}
        assert all(np.isfinite(r) and r > 0 for order in rates.values() for r in order.values())
        for cache in ("cache_off", "cache_warm"):
            latency = engine["lone_latency_ms"][cache]
            assert 0 < latency["p50"] <= latency["p99"] and latency["runs"] >= 20


def test_packed_figures_and_padding_efficiency(run):
    _, report, _ = run
    for name, engine in report["engines"].items():
        for mix in ("fixture", "long-tailed"):
            for rows in ("8", "16"):
                figure = engine["packed"][mix][rows]
                assert figure["tokens_per_s"] > 0, (name, mix, rows)
                assert figure["padding_efficiency"] >= 0.85, (name, mix, rows)  # rows refilled as sentences end
        assert set(engine["run_padding_efficiency"]) == {"1", "4"}
    assert report["bulk"]["sentences"] == 120 and report["bulk"]["tokens_per_s"] > 0
    assert "service" not in report  # --clients ''


def test_goal_table_is_written_and_printed(run):
    out, report, stdout = run
    table = (out / "gpu.md").read_text()
    assert table in stdout
    figures = {row["figure"]: row for row in report["figures"]}
    for row in figures.values():
        assert f"| {row['figure']} |" in table
    # without the yardstick (--no-torch) its fractions are not known; the rest are measured
    assert figures["fp32 engine, 8 rows in flight, over the fp32 yardstick at 8 rows"]["value"] is None
    assert figures["fp32 engine over allennlp's biLM, batch 4"]["value"] is None
    assert figures["elmo-embed over the engine at 16 rows"]["value"] > 0
    assert figures["padding efficiency, long-tailed mix, 16 rows in flight"]["met"] is True
    assert figures["fp32 max abs error vs the CPU provider's fp32"]["met"] is True
    assert figures["fp32 batch independence (alone vs in 30 and 256), max abs diff"]["met"] is True
    assert figures["fp16 min cosine vs the CPU's fp32"]["value"] >= 0.999


def test_the_yardstick_on_the_cpu_is_the_project_bilm_eager(tiny_dir):
    from bench.gpu import yardstick

    paths = {"options": tiny_dir / "options.json", "weights": tiny_dir / "lm_weights.hdf5"}
    figures = yardstick(paths, "cpu", [1, 4], 0.05, ["fp32", "bf16"])
    assert figures["kind"] == "eager on the CPU"
    for precision in ("fp32", "bf16"):
        assert figures[precision]["4"]["tokens_per_s"] > 0 and figures[precision]["1"]["ms_per_call"] > 0


def test_torch_baseline_equals_the_reference(tiny_dir, sentences, expected):
    import torch

    from bench.gpu import torch_runner

    torch.set_num_threads(1)
    run = torch_runner({"options": tiny_dir / "options.json", "weights": tiny_dir / "lm_weights.hdf5"}, "cpu")
    got = run(sentences[:5])
    assert max(float(np.abs(g - w).max()) for g, w in zip(got, expected[:5], strict=True)) <= 1e-5


def test_batches_are_whole_and_the_sorted_pool_is_sorted(sentences):
    from bench.gpu import batches_of

    fixture = batches_of(sentences, 4, "fixture")
    assert [len(b) for b in fixture] == [4] * 8 and fixture[0] == sentences[:4]
    ordered = batches_of(sentences, 32, "sorted")
    assert [len(b) for b in ordered] == [32, 32]
    lengths = [len(s) for b in ordered for s in b]
    assert lengths == sorted(lengths)
    assert batches_of(sentences, 1, "fixture") == [[s] for s in sentences]


def test_allennlp_baseline_is_run_per_batch_on_the_device(tmp_path, tiny_dir, sentences):
    """The glue to bench/allennlp_baseline.py, with a stand-in interpreter that echoes the script's last line."""
    from bench.gpu import ALLENNLP_SCRIPT, allennlp

    calls = tmp_path / "calls.txt"
    fake = tmp_path / "python"
    fake.write_text(
        "#!/bin/sh\n"
        f'echo "$@" >> {calls}\n'
        'if [ "$9" = 13 ]; then echo "Traceback: boom" >&2; exit 1; fi\n'
        'echo "loading..."; echo \'{"impl": "allennlp-2.10.1", "tokens_per_s": 1234.5}\'\n'
    )
    fake.chmod(0o755)
    paths = {"options": tiny_dir / "options.json", "weights": tiny_dir / "lm_weights.hdf5"}
    result = allennlp(str(fake), paths, sentences, [4, 13], "cuda:0", 0.1)
    assert result["4"] == 1234.5
    assert result["13"] == {"error": ["Traceback: boom"]}
    lines = calls.read_text().splitlines()
    assert len(lines) == 2
    assert lines[0].startswith(str(ALLENNLP_SCRIPT)) and "--device cuda:0" in lines[0]
    assert "--batch-size 4 " in lines[0] and "--warmup 2" in lines[0]
