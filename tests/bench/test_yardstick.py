"""bench/yardstick.py: the FLOPs a token costs, counted from a model's options, and what the benchmarks print about
the machine's own limit (a real ONNX Runtime product measured, briefly)."""

from __future__ import annotations

import dataclasses
import re

import pytest

from bench.common import FULL_OPTIONS, TINY
from bench.yardstick import (
    FLAGS,
    STEP_ROWS,
    Yardstick,
    bulk_batches,
    cpu,
    flops_by_part,
    flops_per_token,
    gemm_rates,
    made_up_sentences,
)
from model_export.options import load_options


def test_a_full_size_token_costs_204_mflop_by_part():
    # The published 2x4096_512_2048cnn_2xhighway model, by hand: the LSTMs' four layer-directions each multiply
    # [x; h] (1024) by 4 gates x 4096 cells and project 4096 -> 512; seven convolutions over 50 chars; two
    # highways of 2048 -> 2 x 2048; the projection 2048 -> 512.
    parts = flops_by_part(load_options(FULL_OPTIONS))
    assert parts["lstm"] == 2 * 4 * (1024 * 4 * 4096 + 4096 * 512)  # 151.0 M
    widths = ((1, 32), (2, 32), (3, 64), (4, 128), (5, 256), (6, 512), (7, 1024))
    assert parts["char_cnn"] == 2 * sum(w * 16 * n * (50 - w + 1) for w, n in widths)  # 17.6 M
    assert parts["highway"] == 2 * 2 * 2048 * 4096  # 33.6 M
    assert parts["projection"] == 2 * 2048 * 512  # 2.1 M
    assert flops_per_token(load_options(FULL_OPTIONS)) == pytest.approx(204.3e6, abs=0.05e6)


def test_the_count_follows_the_options_not_a_constant():
    tiny = load_options(TINY / "options.json")
    wider = dataclasses.replace(tiny, cell_dim=2 * tiny.cell_dim)
    # the gate products grow with the cells, the rest of the model does not
    grown = flops_by_part(wider)["lstm"] - flops_by_part(tiny)["lstm"]
    assert grown == 2 * 2 * tiny.n_layers * (2 * tiny.proj_dim * 4 + tiny.proj_dim) * tiny.cell_dim
    assert flops_per_token(wider) - flops_per_token(tiny) == grown
    assert flops_per_token(tiny) < flops_per_token(load_options(FULL_OPTIONS)) / 100


def test_ceilings_fractions_and_lines():
    opt = load_options(FULL_OPTIONS)
    flops = flops_per_token(opt)
    start = {"fp32": {64: 100e9, 512: 150e9}, "int8": {64: 300e9, 512: 400e9}}
    end = {"fp32": {64: 80e9, 512: 50e9}, "int8": {64: 200e9, 512: 100e9}}
    yardstick = Yardstick(threads=2, start=start)
    assert yardstick.ceiling("fp32", opt) == pytest.approx(150e9 / flops)  # the faster row count; start alone
    yardstick.end = end
    assert yardstick.rate("fp32") == pytest.approx((150e9 + 80e9) / 2)  # the mean of start and end
    assert yardstick.ceiling("int8", opt, "end") == pytest.approx(200e9 / flops)
    tokens_per_s = 0.5 * (400e9 + 200e9) / 2 / flops
    assert yardstick.fraction("int8", opt, tokens_per_s) == pytest.approx(0.5)
    assert yardstick.fraction("fp16", opt, 100.0) is None  # no CPU yardstick for it

    assert (
        yardstick.result("bulk int8", "int8", opt, tokens_per_s)
        == f"bulk int8: {tokens_per_s:.0f} tok/s = 0.50 of the int8 ceiling"
    )
    assert "no CPU yardstick for fp16" in yardstick.result("cuda fp16", "fp16", opt, 1000.0)
    lines = yardstick.lines(opt)
    assert lines[0].startswith("CPU: ") and "flags" in lines[0]
    assert lines[1].startswith("model: 204.3 MFLOP a token (lstm 151.0, char_cnn 17.6, highway 33.6, projection 2.1)")
    fp32 = lines[2]
    assert "[64 / 512, 1024] x [1024, 16384], 2 threads: 100.0 / 150.0 -> 80.0 / 50.0 GFLOP/s" in fp32
    assert f"ceiling {150e9 / flops:.0f} -> {80e9 / flops:.0f} tok/s" in fp32


def test_the_cpu_line_names_only_known_flags():
    info = cpu()
    assert info["model"]
    assert set(info["flags"]) <= set(FLAGS)
    with open("/proc/cpuinfo") as f:
        first = f.read().split("\n\n", 1)[0]
    flags = set(re.search(r"^flags\s*:(.*)$", first, re.M).group(1).split())
    assert ("AVX2" in info["flags"]) == ("avx2" in flags)
    assert ("VNNI" in info["flags"]) == bool({"avx512_vnni", "avx_vnni"} & flags)


def test_the_gemm_is_measured_for_real_in_both_precisions():
    rates = gemm_rates(threads=1, seconds=0.01)
    assert set(rates) == {"fp32", "int8"}
    for by_rows in rates.values():
        assert set(by_rows) == set(STEP_ROWS)
        # at least 1 GFLOP/s and at most 100 TFLOP/s: a real product of the step shape was timed
        assert all(1e9 < rate < 1e14 for rate in by_rows.values()), by_rows


def test_made_up_sentences_never_repeat_a_word_and_batch_like_elmo_embed():
    sentences = made_up_sentences(360)
    words = [w for s in sentences for w in s]
    assert len(words) == len(set(words)) and all(5 <= len(s) <= 40 for s in sentences)
    assert made_up_sentences(360) == sentences  # seeded: the same text in every run
    batches = bulk_batches(sentences, tokens=4096)
    assert sorted(map(len, [s for b in batches for s in b])) == sorted(map(len, sentences))
    assert all(len(b) * (max(map(len, b)) + 2) <= 4096 for b in batches)
