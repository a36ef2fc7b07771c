"""Engine speed on the full-size published architecture (random weights): ONNX Runtime vs the PyTorch module.

    .venv/bin/python -m bench.engine [--threads 2] [--provider cpu|cuda] [--batches 1,32] [--graph loop|window]
        [--precision fp32,int8]

Prints tokens/s of each path at each batch size on the fixture sentences (for ONNX Runtime also with the
batches cut from length-sorted sentences, as a bulk job cuts them), and each as the fraction of its precision's
ceiling (bench/yardstick.py: ONNX Runtime's GEMM at the LSTM step's shape, fp32 and int8, measured at the start
and the end of this run, with the CPU's flags; the torch path against fp32's). The fraction counts the model's
nominal work; the engine skips some (the char-CNN of repeated and cached words, frequent in the fixture), so a
fraction here can pass what the products alone would allow (bench.yardstick --embed measures without repeats).
With several precisions (`--precision fp32,int8`), the engines run every batch in turn (fp32, then int8, on the same
batch), so that a noisy machine slows them alike, and each reduced precision's speed is also given as a ratio to
fp32's, and its error against fp32.
"""

from __future__ import annotations

import argparse

import torch

from bench.common import FULL_OPTIONS, fixture_sentences, full_size_model, in_turn
from bench.yardstick import Yardstick
from model_export.export import torch_layers
from model_export.options import load_options
from model_export.weights import load_bilm
from service.engine.canary import cosine_min, max_abs_error
from service.engine.session import Engine


def tokens_per_s(run, sentences: list[list[str]], batch: int, min_seconds: float) -> float:
    """Embed the sentences in batches of `batch` (first pass is warm-up), repeat until min_seconds."""
    return in_turn({"": run}, _cut(sentences, batch), seconds=min_seconds)[""]


def _cut(sentences: list[list[str]], batch: int) -> list[list[list[str]]]:
    return [sentences[i : i + batch] for i in range(0, len(sentences), batch)]


def size(engine: Engine) -> float:
    """MB of the engine's graph file (and of its external data, if any)."""
    return sum(f.stat().st_size for f in engine.graph.file.parent.glob(engine.graph.file.name + "*")) / 1e6


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
    parser.add_argument("--precision", default="fp32", help="fp32, int8 or fp16, or several: fp32,int8")
    args = parser.parse_args()

    opt = load_options(FULL_OPTIONS)
    folder = full_size_model()
    sentences = fixture_sentences()
    precisions = args.precision.split(",")
    engines = {
        p: Engine(folder / "onnx", args.provider, args.threads, precision=p, graph=args.graph) for p in precisions
    }
    torch.set_num_threads(args.threads)
    model = None if args.no_torch else load_bilm(folder / "options.json", folder / "weights.hdf5")

    check = sentences[:4]
    reference = torch_layers(model, check) if model is not None else None
    for precision, engine in engines.items():
        got = engine.run(check)
        if precision == "fp32" and reference is not None:
            print(f"max abs error ONNX Runtime vs PyTorch on the full-size model: {max_abs_error(got, reference):.2e}")
        elif precision != "fp32" and "fp32" in engines:
            fp32 = engines["fp32"].run(check)
            print(
                f"{precision} vs fp32 on the full-size model: max abs error {max_abs_error(got, fp32):.3g}, "
                f"min cosine {cosine_min(got, fp32):.6f}; graph file {engine.graph.file.name} {size(engine):.0f} MB "
                f"(fp32: {size(engines['fp32']):.0f} MB)"
            )
    cpu_yardstick = args.provider == "cpu"  # a GPU run measures against bench.gpu's yardstick
    yardstick = Yardstick(args.threads) if cpu_yardstick else None
    if yardstick:
        print("\n".join(yardstick.lines(opt)), flush=True)
    tokens = sum(map(len, sentences))
    for precision, engine in engines.items():
        print(f"{precision}: provider {engine.provider}, {engine.graph.kind} graph {engine.graph.file.name}")
    print(f"{len(sentences)} sentences, {tokens} tokens; several paths in one row ran every batch in turn")
    print(f"{'path':<22}{'batch':>6}{'tokens/s':>11}{'of ceiling':>12}{'x fp32':>8}")
    rows = []
    for batch in map(int, args.batches.split(",")):
        data = sentences * max(1, -(-batch // len(sentences)))  # at least one full batch
        runs = {f"onnxruntime {p}": e.run for p, e in engines.items()}
        paths = [(runs, data)]
        if batch > 1:
            # The same sentences in batches of alike lengths, as elmo-embed cuts a file; the batches above mix
            # lengths 3 to 53 as concurrent clients' sentences come, and each runs as many steps as its longest.
            sorted_runs = {f"  length-sorted {p}": e.run for p, e in engines.items()}
            paths.append((sorted_runs, sorted(sentences * max(2, -(-2 * batch // 30)), key=len)))
        if model is not None:
            paths.append(({"torch eager": lambda b: torch_layers(model, b)}, data))
        for runs_, cut in paths:
            measured = in_turn(runs_, _cut(cut, batch), seconds=args.seconds)
            base = next((tps for name, tps in measured.items() if name.endswith(" fp32")), None)
            for name, tps in measured.items():
                ratio = f"{tps / base:.2f}x" if base and not name.endswith((" fp32", " eager")) else ""
                precision = "fp32" if name.endswith(" eager") else name.rsplit(" ", 1)[1]
                rows.append((name, batch, tps, precision, ratio))
                print(f"{name:<22}{batch:>6}{tps:>11.0f}{'':>12}{ratio:>8}", flush=True)
    if yardstick:  # the fractions against the mean of the start's and the end's ceilings
        yardstick.finish()
        print("\n".join(yardstick.lines(opt)))
        for name, batch, tps, precision, ratio in rows:
            fraction = yardstick.fraction(precision, opt, tps)
            share = "" if fraction is None else f"{fraction:.2f}"
            print(f"{name:<22}{batch:>6}{tps:>11.0f}{share:>12}{ratio:>8}")


if __name__ == "__main__":
    main()
