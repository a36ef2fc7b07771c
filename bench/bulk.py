"""Bulk embedding, whole process: `elmo-embed` vs allennlp 2.10.1's ELMo (batches of 64) on the same file and weights.

    .venv/bin/python -m bench.bulk [--repeat 3] [--lines 600] [--batch-tokens 4096] [--threads 2]
        [--precision fp32,int8] [--busy-cores 0] [--allennlp-python /work/allennlp-venv/bin/python] [--made-up 360]

Writes the fixture sentences repeated to --lines lines under build/bench/ (or, with --made-up N, N sentences of
distinct made-up words: no word repeats, so no token cache saves any of a token's FLOPs), then times each tool's
whole process (wall clock around the subprocess: start-up, imports, model load, embedding, hdf5 output) and its peak
resident memory, --repeat rounds in which every tool runs once in turn (elmo-embed in each --precision, then
allennlp), so that a noisy machine's slow spells fall on all of them alike. Before each run it waits until other
processes leave the cores idle, and it runs again a run that they disturbed; `--busy-cores N` tolerates N cores
kept busy by others throughout (a training job on one core: 1), and says so in the output.

Prints allennlp's own JSON figures, the max abs error between elmo-embed (fp32) and allennlp on the first sentence
(allennlp is stateful, so only its first batch starts from the zero state that elmo-embed always uses), each
reduced precision's error against fp32 over the whole output (max abs, min cosine per token vector of each layer),
a table of wall s (best / median), tokens/s (best) and peak memory per tool, the speed-ups over allennlp and over
fp32 (best runs, and medians of the same rounds), and whether the 3x acceptance bar over allennlp holds. Around
the rounds, the yardstick (bench/yardstick.py: ONNX Runtime's GEMM at the LSTM step's shape, fp32 and int8, the
CPU's flags), and each tool's embedding-phase tokens/s (start-up excluded: elmo-embed's own figure, allennlp's
`tokens_per_s`; best of the rounds) as the fraction of its precision's ceiling (allennlp's against fp32's).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import h5py
import numpy as np

from bench.common import BUILD, ROOT, fixture_sentences, full_size_model
from bench.yardstick import Yardstick, made_up_sentences
from model_export.options import load_options
from service.engine.canary import cosine_min

BAR = 3.0
ALLENNLP_SCRIPT = ROOT / "bench" / "allennlp_baseline.py"  # not imported: it stubs modules on import


def busy_cpu_s() -> float:
    """CPU seconds all cores have spent busy since boot (/proc/stat: all but idle and iowait; steal counts)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def wait_quiet(busy_cores: float = 0.0, patience_s: float = 900.0) -> None:
    """Wait until other processes leave the cores idle (at most `busy_cores` + 0.1 CPU s per second)."""
    deadline = time.monotonic() + patience_s
    while True:
        before = busy_cpu_s()
        time.sleep(2)
        if (busy := (busy_cpu_s() - before) / 2) <= busy_cores + 0.1 or time.monotonic() > deadline:
            return
        print(f"  other processes busy ({busy:.1f} cores); waiting", file=sys.stderr)
        time.sleep(10)


def run_once(command: list[str]) -> tuple[float, float, float, str]:
    """(wall s, CPU s of the process, peak resident MB, stdout and stderr) of one run of the command."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        start = time.perf_counter()
        proc = subprocess.Popen(command, cwd=ROOT, stdout=out, stderr=err)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - start
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0), err.seek(0)
        if proc.returncode:
            sys.exit(f"failed ({proc.returncode}): {' '.join(command)}\n{err.read().decode()[-2000:]}")
        return wall, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024, out.read().decode() + err.read().decode()


def alternate(commands: dict[str, list[str]], repeat: int, busy_cores: float, outside: frozenset = frozenset()
              ) -> tuple[dict, dict]:  # fmt: skip
    """`repeat` rounds, each running every command once in turn; a run during which other processes took more than
    `busy_cores` + 0.05 CPU s per wall second is dropped and run again (5 tries). The commands named in `outside`
    run work in processes that are not their children (a local Ray's actors, the raylet's): their runs are only
    started on quiet cores, since that work would count as others'. Returns each command's (wall s, peak MB) per
    round, and its output (stdout, then stderr) per round."""
    runs, stdout = {name: [] for name in commands}, {name: [] for name in commands}
    for _ in range(repeat):
        for name, command in commands.items():
            for _ in range(5):
                wait_quiet(busy_cores)
                busy = busy_cpu_s()
                wall, cpu, peak, output = run_once(command)
                others = (busy_cpu_s() - busy) - cpu
                if name in outside or others <= (busy_cores + 0.05) * wall:
                    runs[name].append((wall, peak))
                    stdout[name].append(output)
                    break
                print(f"  {name}: run of {wall:.1f} s disturbed (others: {others:.1f} CPU s); again", file=sys.stderr)
            else:
                sys.exit(f"no undisturbed run of {name} in 5 tries: the machine is busy (see --busy-cores)")
    return runs, stdout


def layer_errors(path: Path, reference: Path) -> tuple[float, list[float]]:
    """Max abs error and min cosine per layer of one elmo-embed output against another, over every line."""
    with h5py.File(path, "r") as a, h5py.File(reference, "r") as b:
        keys = [k for k in b if k != "sentence_to_index"]
        got, want = [a[k][...] for k in keys], [b[k][...] for k in keys]
    error = max(float(np.abs(x - y).max()) for x, y in zip(got, want, strict=True))
    return error, [cosine_min([x[k : k + 1] for x in got], [y[k : k + 1] for y in want]) for k in range(len(want[0]))]


def embedding_rate(outputs: list[str]) -> float:
    """The best embedding-phase tokens/s of a tool's runs, start-up excluded: elmo-embed's "(N tokens/s)" line, or
    the `tokens_per_s` of allennlp_baseline.py's JSON line."""
    rates = []
    for output in outputs:
        found = re.search(r"\((\d+) tokens/s\)", output) or re.search(r'"tokens_per_s": *([\d.]+)', output)
        if found:
            rates.append(float(found.group(1)))
    return max(rates, default=float("nan"))


def elmo_embed_command() -> list[str]:
    script = Path(sys.executable).with_name("elmo-embed")
    return [str(script)] if script.exists() else [sys.executable, "-m", "service.cli"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--lines", type=int, default=600)
    parser.add_argument("--batch-tokens", type=int, default=4096)
    parser.add_argument("--threads", type=int, default=2, help="threads of both tools")
    parser.add_argument("--precision", default="fp32", help="elmo-embed's precisions, in turn: fp32 or fp32,int8")
    parser.add_argument("--busy-cores", type=float, default=0.0, help="cores other processes keep busy throughout")
    parser.add_argument("--allennlp-python", type=Path, default=Path("/work/allennlp-venv/bin/python"))
    parser.add_argument("--made-up", type=int, default=0, help="N sentences of distinct made-up words instead")
    parser.add_argument("--engine", default="allennlp", choices=["allennlp", "ray"],
                        help="allennlp: elmo-embed against allennlp (default); ray: --engine ray against the local run "
                        "(bench/bulk_ray.py)")  # fmt: skip
    parser.add_argument("--actors", type=int, default=2, help="with --engine ray: the Ray run's actors, 1 thread each")
    parser.add_argument("--memory-lines", type=int, default=200_000,
                        help="with --engine ray: the lines of the memory run (0: none)")  # fmt: skip
    args = parser.parse_args()
    if args.engine == "ray":
        from bench import bulk_ray

        bulk_ray.main(argparse.Namespace(**{**vars(args), "made_up": args.made_up or 720}), elmo_embed_command(),
                      alternate)  # fmt: skip
        return

    folder = full_size_model()
    opt = load_options(folder / "options.json")
    yardstick = Yardstick(args.threads)
    print("\n".join(yardstick.lines(opt)), flush=True)
    sentences = fixture_sentences()
    lines = (sentences * -(-args.lines // len(sentences)))[: args.lines]
    if args.made_up:
        lines = made_up_sentences(args.made_up)
    tokens = sum(map(len, lines))
    text = BUILD / (f"bulk-made-up{args.made_up}.txt" if args.made_up else f"bulk{args.lines}.txt")
    text.write_text("".join(" ".join(s) + "\n" for s in lines), encoding="utf-8")
    theirs_out = BUILD / "bulk-allennlp.hdf5"
    print(f"input: {text.relative_to(ROOT)}: {len(lines)} lines, {tokens} tokens; model: {folder.relative_to(ROOT)}")
    if args.busy_cores:
        print(f"other processes were allowed {args.busy_cores:g} busy cores throughout (of {os.cpu_count()})")

    commands, outputs = {}, {}
    for precision in args.precision.split(","):
        name = f"elmo-embed {precision} (batch-tokens {args.batch_tokens})"
        outputs[name] = BUILD / f"bulk-elmo-embed-{precision}.hdf5"
        commands[name] = [
            *elmo_embed_command(),
            *("--model", str(folder / "onnx"), str(text), str(outputs[name]), "--precision", precision),
            *("--batch-tokens", str(args.batch_tokens), "--threads", str(args.threads), "--no-progress"),
        ]
    allennlp = "allennlp 2.10.1 (batch 64)"
    if args.allennlp_python.exists():
        commands[allennlp] = [
            *(str(args.allennlp_python), str(ALLENNLP_SCRIPT)),
            *("--options", str(folder / "options.json"), "--weights", str(folder / "weights.hdf5")),
            *("--input", str(text), "--output", str(theirs_out)),
            *("--batch-size", "64", "--threads", str(args.threads)),
        ]
    else:
        print(
            f"{args.allennlp_python} not found: allennlp part skipped. Create that venv as the docstring of "
            "bench/allennlp_baseline.py says, or pass --allennlp-python."
        )
    runs, stdout = alternate(commands, args.repeat, args.busy_cores)
    fp32 = next((outputs[n] for n in outputs if " fp32 " in n), None)
    print_errors(runs, stdout, outputs, fp32, allennlp, theirs_out, len(lines))
    print_times(runs, allennlp, tokens)
    print_fractions(yardstick, opt, stdout, allennlp)


def print_fractions(yardstick: Yardstick, opt, stdout, allennlp: str) -> None:
    """The yardstick measured again at the end, and each tool's embedding phase as a fraction of its ceiling."""
    yardstick.finish()
    print("\n".join(yardstick.lines(opt)))
    for name, outputs in stdout.items():
        precision = name.split()[1] if name != allennlp else "fp32"
        tool = name.split(" (")[0]
        print(yardstick.result(f"{tool} embedding phase (best)", precision, opt, embedding_rate(outputs)))


def print_errors(
    runs, stdout, outputs: dict[str, Path], fp32: Path | None, allennlp: str, theirs_out: Path, lines: int
):
    """allennlp's own figures, and each output's error against elmo-embed fp32's."""
    if allennlp in runs:
        report = json.loads(stdout[allennlp][-1].strip().splitlines()[-1])
        print(
            f"allennlp's own figures (last run): process_s {report['process_s']}, load_s {report['load_s']}, "
            f"embed_s {report['embed_s']}, tokens_per_s {report['tokens_per_s']} (embedding only)"
        )
        if fp32:
            with h5py.File(fp32, "r") as a, h5py.File(theirs_out, "r") as b:
                error = float(np.abs(a["0"][...] - b["0"][...]).max())
            print(f"max abs error elmo-embed fp32 vs allennlp, first sentence: {error:.2e} (tolerance 1e-05)")
    for name, path in outputs.items():
        if fp32 and path != fp32:
            error, cosines = layer_errors(path, fp32)
            each = ", ".join(f"{c:.6f}" for c in cosines)
            print(
                f"{name.split(' (')[0]} vs fp32, all {lines} lines: max abs error {error:.3g}, "
                f"min cosine by layer {each}"
            )


def print_times(runs, allennlp: str, tokens: int):
    """Each tool's whole-process times, and the speed-ups against elmo-embed fp32 and allennlp (the bar)."""
    print(f"{'tool (whole process)':<40}{'best s':>9}{'median s':>10}{'tokens/s':>10}{'peak MB':>9}   each run s")
    for name, each in runs.items():
        times = [wall for wall, _ in each]
        best, median, peak = min(times), statistics.median(times), max(mb for _, mb in each)
        print(f"{name:<40}{best:>9.2f}{median:>10.2f}{tokens / best:>10.0f}{peak:>9.0f}   "
              + " ".join(f"{t:.2f}" for t in times))  # fmt: skip

    def speedup(slow: str, fast: str) -> tuple[float, float]:
        slow_t, fast_t = [w for w, _ in runs[slow]], [w for w, _ in runs[fast]]
        per_round = statistics.median(s / f for s, f in zip(slow_t, fast_t, strict=True))
        return min(slow_t) / min(fast_t), per_round

    ours = [name for name in runs if name != allennlp]
    base = next((n for n in ours if " fp32 " in n), None)
    for name in ours:
        if base and name != base:
            best, rounds = speedup(base, name)
            print(f"speed-up {name.split(' (')[0]} vs fp32: {best:.2f}x (best runs), {rounds:.2f}x (median of rounds)")
        if allennlp in runs:
            best, rounds = speedup(allennlp, name)
            holds = "holds" if min(best, rounds) >= BAR else "does NOT hold"
            print(
                f"speed-up {name.split(' (')[0]} vs allennlp: {best:.2f}x (best runs), {rounds:.2f}x (median of "
                f"rounds); {BAR:.0f}x bar {holds}"
            )


if __name__ == "__main__":
    main()
