"""Engine speed on the full-size published architecture (random weights): ONNX Runtime vs the PyTorch module.

    .venv/bin/python -m bench.engine [--threads 2] [--provider cpu|cuda] [--batches 1,32] [--graph loop|window]

Prints tokens/s of each path at each batch size on the fixture sentences (for ONNX Runtime also with the
batches cut from length-sorted sentences, as a bulk job cuts them), the machine's fp32 GEMM rate,
and each path's share of it (2 x multiply-adds per token x tokens/s / GEMM FLOP/s). The share counts the
model's nominal work; the engine skips some (the char-CNN of repeated and cached words), so the ONNX
Runtime share can pass what GEMMs alone would allow.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from bench.common import FULL_OPTIONS, fixture_sentences, full_size_model, gemm_rate
from model_export.export import torch_layers
from model_export.options import load_options
from model_export.weights import load_bilm
from service.engine import Engine


def tokens_per_s(run, sentences: list[list[str]], batch: int, min_seconds: float) -> float:
    """Embed the sentences in batches of `batch` (first pass is warm-up), repeat until min_seconds."""
    batches = [sentences[i : i + batch] for i in range(0, len(sentences), batch)]
    run(batches[0])
    tokens, start = 0, time.perf_counter()
    while True:
        for b in batches:
            run(b)
            tokens += sum(map(len, b))
        if time.perf_counter() - start >= min_seconds:
            return tokens / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--provider", default="cpu")
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--seconds", type=float, default=10.0, help="minimum timed seconds per figure")
    parser.add_argument("--no-torch", action="store_true", help="ONNX Runtime only (e.g. on a GPU machine)")
    parser.add_argument(
        "--graph",
        default="auto",
        choices=["auto", "loop", "window"],
        help="which of the model's graphs (auto: the engine's choice)",
    )
    args = parser.parse_args()

    opt = load_options(FULL_OPTIONS)
    folder = full_size_model()
    sentences = fixture_sentences()
    engine = Engine(folder / "onnx", provider=args.provider, intra_op_threads=args.threads, graph=args.graph)
    torch.set_num_threads(args.threads)
    model = None if args.no_torch else load_bilm(folder / "options.json", folder / "weights.hdf5")

    check = sentences[:4]
    if model is not None:
        error = max(
            float(np.abs(a - b).max()) for a, b in zip(engine.run(check), torch_layers(model, check), strict=True)
        )
        print(f"max abs error ONNX Runtime vs PyTorch on the full-size model: {error:.2e}")
    rates = gemm_rate(args.threads)
    rate = max(rates.values())
    macs = opt.macs_per_token()
    measured = ", ".join(f"{name} {r / 1e9:.0f}" for name, r in rates.items())
    print(f"machine: fp32 GEMM 2048x2048x4096, {args.threads} threads, GFLOP/s: {measured}; yardstick {rate / 1e9:.0f}")
    print(f"model: {macs / 1e6:.1f} M multiply-adds per token")
    tokens = sum(map(len, sentences))
    print(f"provider: {engine.provider}, {engine.graph.kind} graph; {len(sentences)} sentences, {tokens} tokens")
    print(f"{'path':<16}{'batch':>6}{'tokens/s':>11}{'GEMM share':>12}")
    for batch in map(int, args.batches.split(",")):
        data = sentences * max(1, -(-batch // len(sentences)))  # at least one full batch
        paths = [("onnxruntime", engine.run, data)]
        if batch > 1:
            # The same sentences in batches of alike lengths, as elmo-embed cuts a file; the batches above mix
            # lengths 3 to 53 as concurrent clients' sentences come, and each runs as many steps as its longest.
            paths.append(("  length-sorted", engine.run, sorted(sentences * max(2, -(-2 * batch // 30)), key=len)))
        if model is not None:
            paths.append(("torch eager", lambda b: torch_layers(model, b), data))
        for name, run, cut in paths:
            tps = tokens_per_s(run, cut, batch, args.seconds)
            print(f"{name:<16}{batch:>6}{tps:>11.0f}{2 * macs * tps / rate:>11.0%}")


if __name__ == "__main__":
    main()
