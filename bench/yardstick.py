"""The machine's own limit, measured in the same run as a benchmark: ONNX Runtime's GEMM at the LSTM step's shape.

    .venv/bin/python -m bench.yardstick [--threads 2] [--seconds 1] [--options FILE]
        [--embed fp32,int8] [--models DIR,DIR] [--sentences 360] [--profile 60]

A host's speed changes from day to day (and, on a shared VM, from minute to minute), so a benchmark's tokens/s says
little alone. The yardstick is the fastest thing the model's own runtime can do with the model's own largest
product: ONNX Runtime's MatMul of [64 or 512, 1024] x [1024, 16384] (a full-size LSTM step: [x; h] times the four
gates' weights), in fp32 and in dynamic int8 (DynamicQuantizeMatMul, int8 weights), at the benchmark's thread
count, measured at the start and at the end of the run. Divided by the FLOPs a token of the model costs (computed
from its options: char-CNN, highways, projection, the LSTMs' products), it gives a ceiling in tokens/s; every
benchmark prints its tokens/s as a fraction of it, with the CPU's model and flags beside.

Alone, it prints the yardstick; with `--embed`, it also embeds sentences of distinct made-up words (so that no
token repeats and every token costs its full FLOPs; the engines' token cache off) in length-sorted batches of about
4096 padded tokens, as elmo-embed cuts a file, with the engine of each precision and each of `--models` (exported
folders, default: the full-size architecture with random weights) batch by batch in turn, and prints each as
tokens/s and as the fraction of its precision's ceiling: the bulk figure of docs/performance.md, start-up excluded.
With `--profile N`, each of those engines first embeds N such sentences under ONNX Runtime's profiler, and the
share of node time each node type took is printed (the profile of docs/performance.md).
"""

from __future__ import annotations

import argparse
import platform
import random
import string
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from model_export.options import BiLMOptions, load_options

BUILD_PROFILES = Path(__file__).resolve().parents[1] / "build" / "bench" / "profiles"
STEP_ROWS = (64, 512)  # a few sentences' step, and a bulk batch's
STEP_K, STEP_N = 1024, 16384  # [x; h] (2 x 512) -> 4 gates x 4096 cells, the full-size model's
FLAGS = {  # /proc/cpuinfo's names of the instructions that decide a product's speed
    "AVX2": ("avx2",),
    "FMA": ("fma",),
    "AVX-512": ("avx512f",),
    "VNNI": ("avx512_vnni", "avx_vnni"),
    "AMX": ("amx_int8", "amx_tile"),
}


def cpu() -> dict:
    """The CPU's model name and which of FLAGS it has (Linux's /proc/cpuinfo; elsewhere the platform's name)."""
    info = {"model": platform.processor() or platform.machine(), "flags": []}
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return info
    fields = dict(
        line.split(":", 1) for line in text.split("\n\n", 1)[0].splitlines() if ":" in line
    )  # the first core's
    fields = {key.strip(): value.strip() for key, value in fields.items()}
    have = set(fields.get("flags", "").split())
    info["model"] = fields.get("model name", info["model"])
    info["flags"] = [name for name, names in FLAGS.items() if have & set(names)]
    return info


def cpu_line() -> str:
    info = cpu()
    absent = [name for name in FLAGS if name not in info["flags"]]
    return f"CPU: {info['model']}; flags {' '.join(info['flags']) or 'none'} (no {', '.join(absent) or '-'})"


def flops_by_part(opt: BiLMOptions) -> dict[str, int]:
    """FLOPs (2 per multiply-add) one token costs in each part of the biLM, from its options."""
    return {part: 2 * macs for part, macs in opt.macs_by_part().items()}


def flops_per_token(opt: BiLMOptions) -> int:
    return sum(flops_by_part(opt).values())


def flops_line(opt: BiLMOptions) -> str:
    parts = ", ".join(f"{part} {flops / 1e6:.1f}" for part, flops in flops_by_part(opt).items())
    return f"model: {flops_per_token(opt) / 1e6:.1f} MFLOP a token ({parts})"


def _gemm_session(precision: str, threads: int):
    """An ONNX Runtime session of x (M, K) @ W (K, N), W a constant (pre-packed once, as the model's weights are):
    MatMul in fp32, DynamicQuantizeMatMul (x quantized per call, W int8 per column) in int8."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    w = rng.standard_normal((STEP_K, STEP_N), dtype=np.float32) * 0.02
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["rows", STEP_K])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["rows", STEP_N])
    if precision == "fp32":
        nodes, weights = [helper.make_node("MatMul", ["x", "w"], ["y"])], [numpy_helper.from_array(w, "w")]
    else:
        scale = np.abs(w).max(axis=0) / 127
        q = np.clip(np.rint(w / scale), -127, 127).astype(np.int8)
        weights = [numpy_helper.from_array(q, "w"), numpy_helper.from_array(scale.astype(np.float32), "scale"),
                   numpy_helper.from_array(np.zeros(STEP_N, np.int8), "zero")]  # fmt: skip
        nodes = [helper.make_node("DynamicQuantizeMatMul", ["x", "w", "scale", "zero"], ["y"], domain="com.microsoft")]
    graph = helper.make_graph(nodes, "gemm", [x], [y], initializer=weights)
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    model = helper.make_model(graph, opset_imports=opsets, ir_version=8)
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def gemm_rates(threads: int, seconds: float = 1.0) -> dict[str, dict[int, float]]:
    """FLOP/s of ONNX Runtime's product at the step shape, by precision and rows: the mean over about `seconds` of
    calls (after one warm-up call), so that a loaded machine's slow spells count as they do in the benchmark."""
    rates: dict[str, dict[int, float]] = {}
    for precision in ("fp32", "int8"):
        session = _gemm_session(precision, threads)
        rates[precision] = {}
        for rows in STEP_ROWS:
            x = np.random.default_rng(1).standard_normal((rows, STEP_K), dtype=np.float32)
            session.run(None, {"x": x})
            calls, start = 0, time.perf_counter()
            while (spent := time.perf_counter() - start) < seconds or calls < 3:
                session.run(None, {"x": x})
                calls += 1
            rates[precision][rows] = 2 * rows * STEP_K * STEP_N * calls / spent
        del session
    return rates


@dataclass
class Yardstick:
    """The GEMM rates at the start of a run (measured when made) and at its end (`finish`), and the ceilings and
    fractions they give a model. A precision's rate is the faster of its two row counts (the shape the machine
    runs best is its limit); the ceiling a fraction is of is the mean of start and end (the load in between is
    what the benchmark met)."""

    threads: int
    seconds: float = 1.0
    start: dict | None = None
    end: dict | None = None

    def __post_init__(self):
        if self.start is None:
            self.start = gemm_rates(self.threads, self.seconds)

    def finish(self) -> None:
        self.end = gemm_rates(self.threads, self.seconds)

    def rate(self, precision: str, when: str = "mean") -> float | None:
        """FLOP/s of `precision`'s product (fp32 or int8; None for another, e.g. fp16, which has no CPU
        yardstick): at the start, the end, or the mean of both (the start's alone before `finish`)."""
        if precision not in ("fp32", "int8"):
            return None
        start = max(self.start[precision].values())
        end = max(self.end[precision].values()) if self.end else start
        return {"start": start, "end": end, "mean": (start + end) / 2}[when]

    def ceiling(self, precision: str, opt: BiLMOptions, when: str = "mean") -> float | None:
        """Tokens/s the product's rate allows the model, were every FLOP of a token done at it."""
        rate = self.rate(precision, when)
        return None if rate is None else rate / flops_per_token(opt)

    def fraction(self, precision: str, opt: BiLMOptions, tokens_per_s: float) -> float | None:
        ceiling = self.ceiling(precision, opt)
        return None if ceiling is None else tokens_per_s / ceiling

    def lines(self, opt: BiLMOptions) -> list[str]:
        """What a benchmark prints about the yardstick: CPU, the model's FLOPs, each rate and ceiling."""
        out = [cpu_line(), flops_line(opt)]
        for precision in ("fp32", "int8"):
            rows = " / ".join(str(r) for r in STEP_ROWS)
            start = " / ".join(f"{self.start[precision][r] / 1e9:.1f}" for r in STEP_ROWS)
            end = " -> " + " / ".join(f"{self.end[precision][r] / 1e9:.1f}" for r in STEP_ROWS) if self.end else ""
            ceilings = f"{self.ceiling(precision, opt, 'start'):.0f}"
            if self.end:
                ceilings += f" -> {self.ceiling(precision, opt, 'end'):.0f}"
            out.append(
                f"yardstick {precision}: ONNX Runtime GEMM [{rows}, {STEP_K}] x [{STEP_K}, {STEP_N}], "
                f"{self.threads} threads: {start}{end} GFLOP/s (start{' -> end' if self.end else ''}); "
                f"ceiling {ceilings} tok/s"
            )
        return out

    def result(self, name: str, precision: str, opt: BiLMOptions, tokens_per_s: float) -> str:
        """`name`: N tok/s = F of the ceiling (fp32's or int8's; for another precision, tok/s alone)."""
        fraction = self.fraction(precision, opt, tokens_per_s)
        if fraction is None:
            return f"{name}: {tokens_per_s:.0f} tok/s (no CPU yardstick for {precision})"
        return f"{name}: {tokens_per_s:.0f} tok/s = {fraction:.2f} of the {precision} ceiling"


def made_up_sentences(count: int, seed: int = 0) -> list[list[str]]:
    """`count` sentences of 5 to 40 words of 2 to 12 letters, no word twice: no token cache or repeated word within
    a batch saves any of the char-CNN's work, so every token costs flops_per_token."""
    rng, seen, sentences = random.Random(seed), set(), []
    for _ in range(count):
        length, sentence = rng.randint(5, 40), []
        while len(sentence) < length:
            word = "".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 12)))
            if word not in seen:
                seen.add(word)
                sentence.append(word)
        sentences.append(sentence)
    return sentences


def bulk_batches(sentences: list[list[str]], tokens: int = 4096) -> list[list[list[str]]]:
    """Length-sorted batches of at most `tokens` padded positions (boundaries included), as elmo-embed cuts a file."""
    batches, batch = [], []
    for sentence in sorted(sentences, key=len):
        if batch and (len(batch) + 1) * (len(sentence) + 2) > tokens:
            batches.append(batch)
            batch = []
        batch.append(sentence)
    return [*batches, batch]


def profiled_engine(model: Path, precision: str, threads: int, **engine):
    """An engine of `model` in `precision` (token cache off) under ONNX Runtime's profiler; `engine`: more of
    Engine's keyword arguments."""
    import service.engine.session as session_module

    original = session_module.session_options

    def profiled(intra: int, inter: int, kernels: bool = True):
        options = original(intra, inter, kernels)
        options.enable_profiling = True
        options.profile_file_prefix = str(BUILD_PROFILES / f"{Path(model).name}-{precision}")
        return options

    BUILD_PROFILES.mkdir(parents=True, exist_ok=True)
    session_module.session_options = profiled
    try:
        return session_module.Engine(model, "cpu", threads, 1, **{"token_cache": 0, **engine}, precision=precision)
    finally:
        session_module.session_options = original


INLINED = "_inlfunc_"  # how ONNX Runtime names the nodes it inlines from a function's body


def node_times(engine, warm_runs: int = 1) -> dict[str, tuple[str, float]]:
    """Each node's name -> (its type, its seconds) in a `profiled_engine`'s calls but its first `warm_runs`, from
    ONNX Runtime's profiler, which this ends. The Loop bodies' nodes count as theirs (named `.../step/...`), and a
    `Loop` node's seconds are its own beyond its body's nodes (its scheduling of the steps). The nodes ONNX Runtime
    inlined from a function (ElmoCellStep's standard ops, where no kernel runs it) lose their scope (`INLINED`):
    their seconds come off the Loops' in proportion to what is left of each."""
    import json

    path = Path(engine.session.end_profiling())
    events = json.loads(path.read_text())
    path.unlink()
    runs = sorted(e["ts"] + e["dur"] for e in events if e.get("name") == "model_run")
    warm_until = runs[warm_runs - 1] if warm_runs else 0
    nodes: dict[str, tuple[str, float]] = {}
    for event in events:
        if event.get("cat") == "Node" and event["name"].endswith("_kernel_time") and event["ts"] >= warm_until:
            name, op = event["name"].removesuffix("_kernel_time"), event["args"]["op_name"]
            nodes[name] = (op, nodes.get(name, (op, 0.0))[1] + event["dur"] / 1e6)
    for name, (op, seconds) in list(nodes.items()):
        if op == "Loop":  # a Loop's kernel time includes its body's nodes, profiled too
            scope = name.rsplit("/", 1)[0] + "/step/"
            inside = sum(s for n, (_, s) in nodes.items() if n.startswith(scope))
            nodes[name] = (op, seconds - inside)
    inlined = sum(s for n, (_, s) in nodes.items() if n.startswith(INLINED))
    loops = {n: s for n, (op, s) in nodes.items() if op == "Loop"}
    for name, seconds in loops.items():
        nodes[name] = ("Loop", seconds - inlined * seconds / (sum(loops.values()) or 1.0))
    return nodes


def profile_nodes(model: Path, precision: str, threads: int, batches: list) -> dict[str, tuple[str, float]]:
    """`node_times` while an engine of `model` in `precision` embeds the batches (after a warm-up call)."""
    engine = profiled_engine(model, precision, threads)
    for batch in [batches[0], *batches]:
        engine.run(batch)
    return node_times(engine)


def profile(model: Path, precision: str, threads: int, batches: list) -> dict[str, float]:
    """Seconds of each node type (`profile_nodes`), largest first."""
    by_type: dict[str, float] = {}
    for op, seconds in profile_nodes(model, precision, threads, batches).values():
        by_type[op] = by_type.get(op, 0.0) + seconds
    return dict(sorted(by_type.items(), key=lambda item: -item[1]))


def profile_lines(name: str, by_type: dict[str, float], top: int = 10) -> list[str]:
    total = sum(by_type.values())
    shares = ", ".join(f"{op} {seconds / total:.1%}" for op, seconds in list(by_type.items())[:top])
    return [f"profile {name}: {total:.2f} s of node time; {shares}"]


def main() -> None:
    from bench.common import FULL_OPTIONS, full_size_model, in_turn

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=1.0, help="seconds per GEMM figure")
    parser.add_argument("--options", type=Path, default=FULL_OPTIONS, help="the model whose FLOPs a token costs")
    parser.add_argument("--embed", default="", help="precisions to embed made-up sentences with: fp32,int8")
    parser.add_argument("--models", default="", help="exported folders, compared in turn (default: full size)")
    parser.add_argument("--sentences", type=int, default=360)
    parser.add_argument("--rounds", type=int, default=1, help="passes over the sentences")
    parser.add_argument("--profile", type=int, default=0, help="profile each engine on N sentences first")
    args = parser.parse_args()

    opt = load_options(args.options)
    yardstick = Yardstick(args.threads, args.seconds)
    print("\n".join(yardstick.lines(opt)), flush=True)
    if not args.embed:
        return
    from service.engine.session import Engine

    models = [Path(m) for m in args.models.split(",") if m] or [full_size_model() / "onnx"]
    if args.profile:
        profiled = bulk_batches(made_up_sentences(args.profile, seed=1))
        for model in models:
            for precision in args.embed.split(","):
                by_type = profile(model, precision, args.threads, profiled)
                print("\n".join(profile_lines(f"{model} {precision}", by_type, top=12)), flush=True)
    engines = {
        f"{model} {precision}": Engine(model, "cpu", args.threads, 1, token_cache=0, precision=precision)
        for model in models
        for precision in args.embed.split(",")
    }
    sentences = made_up_sentences(args.sentences)
    batches = bulk_batches(sentences)
    print(f"{len(sentences)} made-up sentences, {sum(map(len, sentences))} distinct tokens, {len(batches)} batches")
    rates = in_turn({n: e.run for n, e in engines.items()}, batches, rounds=args.rounds)
    yardstick.finish()
    print("\n".join(yardstick.lines(opt)))
    for name, tokens_per_s in rates.items():
        print(yardstick.result(f"bulk {name}", name.rsplit(" ", 1)[1], opt, tokens_per_s))


if __name__ == "__main__":
    main()
