"""Bulk embedding on Ray against the local run, in the same process: `python -m bench.bulk --engine ray`.

    .venv/bin/python -m bench.bulk --engine ray [--made-up 720] [--repeat 2] [--actors 2] [--memory-lines 200000]
        [--busy-cores 0]

Throughput: the full-size shape (random weights of the published 2x4096_512 architecture), --made-up sentences of
distinct made-up words (no token repeats, so the token cache saves nothing), `elmo-embed` with 2 threads against
`elmo-embed --engine ray --actors 2 --threads 1` (a local Ray that the run starts and stops: its raylet, object
store and two actors on the same 2 cores), --repeat rounds in turn. Each tool's whole-process wall time on the file
and on 8 lines of it: tokens/s whole, and steady (tokens / (wall - wall on 8 lines): start-up, Ray's included,
subtracted), the Ray/local ratios, and whether the two outputs are the same bits. A Ray run's actors are not the
driver's children, so other processes' load is checked before it starts, not during it (bench/bulk.py alternate).

Memory: the tiny fixture model on --memory-lines lines (and a quarter of them) of short distinct sentences, Ray with
--actors actors: the driver's peak resident memory (the elmo-embed process) and a worker's (what its actors report),
hdf5 (whose merge holds sentence_to_index, as the local run does) and Parquet (nothing held per line). The driver's
memory should not grow with the lines but for that index. The CPU's flags are printed beside every figure.
"""

from __future__ import annotations

import random
import re
import string
import sys
from pathlib import Path

import h5py
import numpy as np

from bench.common import BUILD, full_size_model, tiny_model
from bench.yardstick import cpu_line, made_up_sentences

SMALL = 8  # lines of the start-up run


def _write(path: Path, sentences: list[list[str]]) -> Path:
    path.write_text("".join(" ".join(s) + "\n" for s in sentences))
    return path


def _short_sentences(count: int, seed: int = 0) -> list[list[str]]:
    """`count` distinct short sentences (4-8 tokens of made-up words): many lines, little work each."""
    rng = random.Random(seed)
    return [[*("".join(rng.choices(string.ascii_lowercase, k=5)) for _ in range(rng.randint(3, 7))), f"w{i}"]
            for i in range(count)]  # fmt: skip


def _same_bits(a: Path, b: Path) -> bool:
    with h5py.File(a, "r") as x, h5py.File(b, "r") as y:
        return sorted(x) == sorted(y) and all(
            name == "sentence_to_index" or np.array_equal(x[name][...], y[name][...]) for name in x
        )


def main(args, elmo_embed: list[str], alternate) -> None:
    folder = BUILD / "bulk-ray"
    folder.mkdir(parents=True, exist_ok=True)
    print(cpu_line())
    model = full_size_model() / "onnx"
    sentences = made_up_sentences(args.made_up)
    tokens = sum(map(len, sentences))
    big, small = _write(folder / "in.txt", sentences), _write(folder / "small.txt", sentences[:SMALL])
    small_tokens = sum(map(len, sentences[:SMALL]))
    ray = ["--engine", "ray", "--actors", str(args.actors), "--threads", "1"]
    commands = {}
    for name, extra in (("local", ["--threads", "2"]), ("ray", ray)):
        for size, source in (("file", big), ("start-up", small)):
            out = folder / f"{name}-{size}.hdf5"
            commands[f"{name} {size}"] = [*elmo_embed, "--model", str(model), "--no-progress", *extra, str(source),
                                          str(out)]  # fmt: skip
    print(f"throughput: full-size shape, {len(sentences)} made-up sentences ({tokens} tokens), {args.repeat} rounds")
    runs, _ = alternate(commands, args.repeat, args.busy_cores, outside=frozenset({"ray file", "ray start-up"}))
    best = {name: min(wall for wall, _ in walls) for name, walls in runs.items()}
    rates = {}
    for name in ("local", "ray"):
        whole = tokens / best[f"{name} file"]
        steady = (tokens - small_tokens) / (best[f"{name} file"] - best[f"{name} start-up"])
        rates[name] = (whole, steady)
        print(f"  {name:6} wall {best[f'{name} file']:6.1f} s (start-up run {best[f'{name} start-up']:.1f} s): "
              f"{whole:6.0f} tok/s whole, {steady:6.0f} tok/s steady")  # fmt: skip
    print(f"  ray / local: whole {rates['ray'][0] / rates['local'][0]:.2f}, steady "
          f"{rates['ray'][1] / rates['local'][1]:.2f} (goal >= 0.85); "
          f"same bits: {_same_bits(folder / 'ray-file.hdf5', folder / 'local-file.hdf5')}")  # fmt: skip
    if args.memory_lines:
        _memory(args, folder, elmo_embed, alternate)


def _memory(args, folder: Path, elmo_embed: list[str], alternate) -> None:
    print(f"memory: the tiny fixture model, Ray with {args.actors} actors; {cpu_line()}")
    model = tiny_model()
    for lines in (args.memory_lines // 4, args.memory_lines):
        source = _write(folder / f"memory-{lines}.txt", _short_sentences(lines))
        for fmt in ("hdf5", "parquet"):
            out = folder / f"memory-{lines}.{fmt}"
            command = [*elmo_embed, "--model", str(model), "--no-progress", "--engine", "ray", "--actors",
                       str(args.actors), "--threads", "1", "--format", fmt, str(source), str(out)]  # fmt: skip
            runs, outputs = alternate({"ray": command}, 1, args.busy_cores, outside=frozenset({"ray"}))
            (wall, _), text = runs["ray"][0], outputs["ray"][0]
            driver, worker = re.search(r"driver (\d+) MB, a worker (\d+) MB", text).groups()
            print(f"  {lines:>7} lines, {fmt:7}: peak resident memory: driver {driver:>5} MB, a worker {worker:>5} MB; "
                  f"{wall:5.1f} s")  # fmt: skip


if __name__ == "__main__":
    sys.exit("run it as python -m bench.bulk --engine ray")
