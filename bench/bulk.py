"""Bulk embedding, whole process: `elmo-embed` vs allennlp 2.10.1's ELMo (batches of 64) on the same file and weights.

    .venv/bin/python -m bench.bulk [--repeat 3] [--lines 600] [--batch-tokens 4096] [--threads 2]
        [--allennlp-python /work/allennlp-venv/bin/python]

Writes the fixture sentences repeated to --lines lines under build/bench/, then times each tool's whole process
(wall clock around the subprocess: start-up, imports, model load, embedding, hdf5 output) --repeat times, each
run on a quiet machine (it waits while other processes use the CPU). Prints allennlp's own JSON figures, the max
abs error between the two outputs on the first sentence (allennlp is stateful, so only its first batch starts
from the zero state that elmo-embed always uses), a table of wall s (best / median) and tokens/s per tool,
the speed-up of elmo-embed over allennlp, and whether the 3x acceptance bar holds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import h5py
import numpy as np

from bench.common import BUILD, ROOT, fixture_sentences, full_size_model

BAR = 3.0
ALLENNLP_SCRIPT = ROOT / "bench" / "allennlp_baseline.py"  # not imported: it stubs modules on import


def cpu_busy(seconds: float = 1.0) -> float:
    """Fraction of all cores busy over the next `seconds` (from /proc/stat)."""

    def sample() -> tuple[int, int]:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        idle = fields[3] + fields[4]  # idle + iowait
        return sum(fields) - idle, sum(fields)

    busy0, total0 = sample()
    time.sleep(seconds)
    busy1, total1 = sample()
    return (busy1 - busy0) / max(1, total1 - total0)


def wait_quiet(threshold: float = 0.15, patience_s: float = 600.0) -> None:
    """Wait until other processes leave the CPU idle (a timed run must have the cores to itself)."""
    deadline = time.monotonic() + patience_s
    while (busy := cpu_busy()) > threshold:
        if time.monotonic() > deadline:
            print(f"warning: CPU still {busy:.0%} busy after {patience_s:.0f} s; timing anyway", file=sys.stderr)
            return
        print(f"CPU {busy:.0%} busy (another process?); waiting", file=sys.stderr)
        time.sleep(10)


def time_process(command: list[str], repeat: int) -> tuple[list[float], str]:
    """Wall seconds of each of `repeat` runs of the command, and the last run's stdout."""
    times, stdout = [], ""
    for _ in range(repeat):
        wait_quiet()
        start = time.perf_counter()
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
        times.append(time.perf_counter() - start)
        if done.returncode:
            sys.exit(f"failed ({done.returncode}): {' '.join(command)}\n{done.stderr[-2000:]}")
        stdout = done.stdout
    return times, stdout


def elmo_embed_command() -> list[str]:
    script = Path(sys.executable).with_name("elmo-embed")
    return [str(script)] if script.exists() else [sys.executable, "-m", "service.cli"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--lines", type=int, default=600)
    parser.add_argument("--batch-tokens", type=int, default=4096)
    parser.add_argument("--threads", type=int, default=2, help="threads of both tools")
    parser.add_argument("--allennlp-python", type=Path, default=Path("/work/allennlp-venv/bin/python"))
    args = parser.parse_args()

    folder = full_size_model()
    sentences = fixture_sentences()
    lines = (sentences * -(-args.lines // len(sentences)))[: args.lines]
    tokens = sum(map(len, lines))
    text = BUILD / f"bulk{args.lines}.txt"
    text.write_text("".join(" ".join(s) + "\n" for s in lines), encoding="utf-8")
    ours_out, theirs_out = BUILD / "bulk-elmo-embed.hdf5", BUILD / "bulk-allennlp.hdf5"
    print(f"input: {text.relative_to(ROOT)}: {len(lines)} lines, {tokens} tokens; model: {folder.relative_to(ROOT)}")

    ours = [
        *elmo_embed_command(),
        *("--model", str(folder / "onnx"), str(text), str(ours_out)),
        *("--batch-tokens", str(args.batch_tokens), "--threads", str(args.threads), "--no-progress"),
    ]
    rows = [(f"elmo-embed (batch-tokens {args.batch_tokens})", time_process(ours, args.repeat)[0])]

    if args.allennlp_python.exists():
        theirs = [
            *(str(args.allennlp_python), str(ALLENNLP_SCRIPT)),
            *("--options", str(folder / "options.json"), "--weights", str(folder / "weights.hdf5")),
            *("--input", str(text), "--output", str(theirs_out)),
            *("--batch-size", "64", "--threads", str(args.threads)),
        ]
        times, stdout = time_process(theirs, args.repeat)
        report = json.loads(stdout.strip().splitlines()[-1])
        rows.append(("allennlp 2.10.1 (batch 64)", times))
        print(
            f"allennlp's own figures (last run): process_s {report['process_s']}, load_s {report['load_s']}, "
            f"embed_s {report['embed_s']}, tokens_per_s {report['tokens_per_s']} (embedding only)"
        )
        with h5py.File(ours_out, "r") as a, h5py.File(theirs_out, "r") as b:
            error = float(np.abs(a["0"][...] - b["0"][...]).max())
        print(f"max abs error elmo-embed vs allennlp, first sentence: {error:.2e} (tolerance 1e-05)")
    else:
        print(
            f"{args.allennlp_python} not found: allennlp part skipped. Create that venv as the docstring of "
            "bench/allennlp_baseline.py says, or pass --allennlp-python."
        )

    print(f"{'tool':<34}{'best s':>9}{'median s':>10}{'tokens/s':>10}   (whole process, {args.repeat} runs)")
    for name, times in rows:
        best, median = min(times), statistics.median(times)
        print(f"{name:<34}{best:>9.2f}{median:>10.2f}{tokens / best:>10.0f}")
    if len(rows) == 2:
        (_, ours_t), (_, theirs_t) = rows
        best = min(theirs_t) / min(ours_t)
        median = statistics.median(theirs_t) / statistics.median(ours_t)
        holds = "holds" if min(best, median) >= BAR else "does NOT hold"
        print(f"speed-up elmo-embed vs allennlp: {best:.2f}x (best), {median:.2f}x (median); {BAR:.0f}x bar {holds}")


if __name__ == "__main__":
    main()
