"""int8 on the CPU: the ways of quantizing the Loop graph, each measured against fp32 in one process.

    .venv/bin/python -m bench.int8 [--model full|small|default] [--schemes row7-s8,export,...] [--seconds 5]
        [--threads 2] [--batches 1,32,bulk|none] [--made-up 240] [--baseline FOLDER]
    .venv/bin/python -m bench.int8 --profile [--model full] [--schemes export,export-vnni,row7-s8-both]
        [--sentences 120] [--rounds 2] [--baseline FOLDER]

Builds each candidate int8 graph of the model (the full-size architecture or the smaller published one, 2x1024_128,
with random weights, or the embedded default model) beside its fp32 export under build/bench/int8/, then prints per
candidate (`--batches none`: its accuracy alone): build seconds, file size,
its error against fp32 on the export's check sentences (max abs, min cosine per token vector, layer 0 and the
layers above it) and on the fixture sentences as one large batch (where a per-tensor scale is the whole batch's),
and tokens/s at batch 1, batch 32 and length-sorted batches of 4096 padded tokens (as elmo-embed cuts a file), with
the ratio to fp32 (`--made-up N`: on N made-up sentences, every token distinct and the token cache off, so each
token costs its char CNN; `export`, `export-vnni`: the export's own graphs; `--baseline FOLDER`: another export's
int8 graph beside them). The engines run batch by batch in turn (fp32, then each candidate, on the same batch), so a
noisy machine slows them alike and the ratios hold where the absolute figures do not; and each rate as the fraction
of its precision's ceiling (bench/yardstick.py: ONNX Runtime's GEMM at the LSTM step's shape, at the start and the
end of the run, the CPU's flags beside).

Candidates: the project's graph writer (model_export/onnx_graph.py: `Int8`), by activations (row7: per row, 7
bits; row8: per row, 8 bits; tensor: per batch, DynamicQuantizeMatMul) and weights (s8 symmetric, u8 asymmetric,
per output column; s7 symmetric in 7 bits, for 8-bit activations on AVX2), `-cnn32` keeping the char-CNN's highways
and projection in fp32, `-bounded` the cell output quantized at its bound, `-conv8` the char convolutions in
integers, `-both` the two, `-fused` each step's input and state in one product, `row8-s8-all` the export's VNNI
graph's scheme (`Int8`'s candidates around the products); and ONNX Runtime's quantizer
(onnxruntime.quantization.quantize_dynamic on model.onnx, EnableSubgraph for the Loop bodies: `ort-...`), per
channel or per tensor (`-pt`), reduced range (`-rr`), uint8 weights (`-u8`), the char-CNN's Conv too (`-conv`).

With `--profile`, the time around the products instead. On a CPU whose integer products are fast (VNNI, AMX) an int8
token's time is decided by what is not an integer product: the char CNN, the cell's pointwise nodes, quantizing
activations, the Loop's own work. This measures that part on any host: each engine (token cache off) embeds the same
length-sorted batches of made-up sentences (every token distinct, so each costs its full char CNN) under ONNX
Runtime's profiler, every batch by each engine in turn after a warm-up round, and each node type's time is divided
by the tokens embedded. "products" are the int8 graph's integer products (`INTEGER_PRODUCTS`) and the fp32 graph's
float ones (`FLOAT_PRODUCTS`); the rest is the "other" figure, also by part of the model (a pass the integer
product's kernel makes itself, as a scale a row, counts as the product's: compare the totals too). Profiled: fp32
and the `--schemes` (default: the export's two int8 graphs as it wrote them, `export` and `export-vnni`; any other
name is a candidate, built afresh). `--baseline FOLDER`: an export of the same model by other code (main's, say),
its fp32 and int8 graphs profiled first in the same turns, and fp32 then built afresh by this tree. The yardstick
and the CPU's flags are printed beside, from the same run.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import time
from pathlib import Path

import numpy as np
import onnx

from bench.common import BUILD, FULL_OPTIONS, ROOT, fixture_sentences, full_size_model, in_turn
from bench.yardstick import INLINED, Yardstick, bulk_batches, made_up_sentences, node_times, profiled_engine
from model_export.export import CHECK_SENTENCES, INT8, INT8_VNNI
from model_export.onnx_graph import Int8, build_onnx_model
from model_export.weights import load_bilm
from service.engine.canary import cosine_min, max_abs_error
from service.engine.session import Engine
from service.manifest import MANIFEST

SCHEMES = {
    "row7-s8": Int8("row7", "s8"),
    "row8-u8": Int8("row8", "u8"),
    "row8-s8": Int8("row8", "s8"),
    "tensor-s8": Int8("tensor", "s8"),
    "tensor-u8": Int8("tensor", "u8"),
    "row7-s8-cnn32": Int8("row7", "s8", token_encoder=False),
    "row8-u8-cnn32": Int8("row8", "u8", token_encoder=False),
    # around the products (docs/performance.md, "The time around the products"); row8 x s8 is exact only with VNNI
    "row7-s8-bounded": Int8("row7", "s8", bounded=True),
    "row7-s8-conv8": Int8("row7", "s8", convolutions=True),
    "row7-s8-both": Int8("row7", "s8", bounded=True, convolutions=True),
    "row8-s7": Int8("row8", "s7"),
    "row8-s7-bounded": Int8("row8", "s7", bounded=True),
    "row8-s8-bounded": Int8("row8", "s8", bounded=True),
    # the step's input and state products as one, in the loop (`Int8.fused`)
    "row7-s8-fused": Int8("row7", "s8", fused=True),
    "row8-s8-fused": Int8("row8", "s8", fused=True),
    "row8-s8-bounded-fused": Int8("row8", "s8", bounded=True, fused=True),
    "row8-s8-conv8": Int8("row8", "s8", convolutions=True),
    "row8-s8-both": Int8("row8", "s8", bounded=True, convolutions=True),
    "row8-s8-all": Int8("row8", "s8", bounded=True, convolutions=True, fused=True),
}
# ONNX Runtime's dynamic quantizer: (per channel, reduced range, uint8 weights, ops)
QUANTIZER = {
    "ort": (True, False, False, ["MatMul"]),
    "ort-pt": (False, False, False, ["MatMul"]),
    "ort-rr": (True, True, False, ["MatMul"]),
    "ort-u8": (True, False, True, ["MatMul"]),
    "ort-conv": (True, False, False, ["MatMul", "Conv"]),
}
DEFAULT = ",".join([*SCHEMES, "ort", "ort-rr", "ort-u8"])
SMALL_OPTIONS = FULL_OPTIONS.with_name("elmo_2x1024_128_2048cnn_1xhighway_options.json")
# --profile's: the export's own int8 graphs (`export`: the one every CPU computes exactly; `export-vnni`: the one an
# engine serves on a CPU with VNNI or AMX), which it profiles as the export wrote them, and candidates it builds
EXPORT_GRAPHS = {"export": "model_int8.onnx", "export-vnni": "model_int8_vnni.onnx"}
PROFILED = ["export", "export-vnni"]
BULK_TOKENS = 4096


def ort_quantized(source: Path, out: Path, per_channel: bool, reduce_range: bool, u8: bool, ops: list[str]) -> None:
    from onnxruntime.quantization import QuantType, quantize_dynamic

    logging.getLogger().setLevel(logging.ERROR)  # its advice to pre-process first, once per call
    quantize_dynamic(
        source, out, op_types_to_quantize=ops, per_channel=per_channel, reduce_range=reduce_range,
        weight_type=QuantType.QUInt8 if u8 else QuantType.QInt8,
        extra_options={"EnableSubgraph": True, "MatMulConstBOnly": True},
    )  # fmt: skip


def candidate_folder(export: Path, name: str, graph: Path, file: str = "model_int8.onnx") -> Path:
    """A folder holding the export's files (linked) with `graph` as its int8 Loop graph (or as `file`)."""
    folder = BUILD / "int8" / export.parent.name / name
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    for item in export.iterdir():
        if item.name not in (MANIFEST, file):
            (folder / item.name).symlink_to(item.resolve())
    shutil.move(graph, folder / file)
    manifest = json.loads((export / MANIFEST).read_text())
    # the candidate is the folder's only int8 graph (an engine would serve the export's VNNI graph on such a CPU)
    manifest["graphs"] = [g for g in manifest["graphs"] if g["precision"] != "int8" or g["file"] == "model_int8.onnx"]
    for entry in manifest["graphs"]:
        if entry["precision"] == "int8":
            entry["quantization"] = name
    (folder / MANIFEST).write_text(json.dumps(manifest))
    return folder


def build(name: str, export: Path, model) -> tuple[Path, float]:
    scratch = BUILD / "int8" / f"{name}.onnx"
    scratch.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    if name in SCHEMES:
        onnx.save(build_onnx_model(model, "int8", SCHEMES[name]), scratch)
    else:
        ort_quantized(export / "model.onnx", scratch, *QUANTIZER[name])
    return candidate_folder(export, name, scratch), time.perf_counter() - start


def errors(got: list[np.ndarray], want: list[np.ndarray]) -> dict[str, float]:
    layer = lambda r, k: [x[k : k + 1] for x in r]  # noqa: E731
    above = [cosine_min(layer(got, k), layer(want, k)) for k in range(1, want[0].shape[0])]
    return {
        "max_abs": max_abs_error(got, want),
        "cos_layer0": cosine_min(layer(got, 0), layer(want, 0)),
        "cos_above0": min(above),
    }


def cut(sentences: list[list[str]], kind: str) -> list[list[list[str]]]:
    """Batches of `kind`: "1", "32" (the fixture order, lengths mixed), or "bulk" (length-sorted, 4096 tokens)."""
    if kind != "bulk":
        size = int(kind)
        data = sentences * max(1, -(-size // len(sentences)))
        return [data[i : i + size] for i in range(0, len(data), size)]
    batches, batch = [], []
    for sentence in sorted(sentences * 8, key=len):
        if batch and (len(batch) + 1) * (len(sentence) + 2) > BULK_TOKENS:
            batches.append(batch)
            batch = []
        batch.append(sentence)
    return [*batches, batch]


INTEGER_PRODUCTS = ("MatMulIntegerToFloat", "DynamicQuantizeMatMul", "MatMulInteger", "QLinearMatMul", "ConvInteger")
FLOAT_PRODUCTS = ("MatMul", "FusedMatMul", "Gemm", "FusedGemm", "Conv", "FusedConv")


def part(name: str) -> str:
    """Where in the model a node is, from its name's scope (model_export/onnx_graph.py names them)."""
    scope = name.split("/", 1)[0] if "/" in name else ""
    if name.startswith(INLINED):  # a node of an ONNX function's body, which only the Loop steps call
        return "LSTM step (in the Loop)"
    if scope.startswith(("char_cnn", "highway", "projection")):
        return "token encoder"
    if scope.startswith("lstm"):
        return "LSTM step (in the Loop)" if "/step/" in name else "LSTM, outside the Loop"
    return "rest of the graph"


def is_product(precision: str, op: str) -> bool:
    return op in (INTEGER_PRODUCTS if precision == "int8" else FLOAT_PRODUCTS)


def per_token(nodes: dict[str, tuple[str, float]], tokens: int, key) -> dict[str, float]:
    """Microseconds of node time a token, summed by `key(name, op)`, largest first."""
    out: dict[str, float] = {}
    for name, (op, seconds) in nodes.items():
        k = key(name, op)
        out[k] = out.get(k, 0.0) + seconds * 1e6 / tokens
    return dict(sorted(out.items(), key=lambda item: -item[1]))


def report(label: str, precision: str, nodes: dict[str, tuple[str, float]], tokens: int) -> list[str]:
    kind = per_token(nodes, tokens, lambda name, op: "products" if is_product(precision, op) else "other")
    products, other = kind.get("products", 0.0), kind.get("other", 0.0)
    lines = [
        f"{label} {precision}: {products + other:.1f} us of node time a token: products {products:.1f}, "
        f"other {other:.1f} ({other / (products + other):.0%})"
    ]
    by_op = per_token(nodes, tokens, lambda name, op: f"{op}{'' if is_product(precision, op) else ' *'}")
    lines.append("  by type (* other): " + ", ".join(f"{op} {us:.1f}" for op, us in by_op.items() if us >= 0.05))
    by_part = per_token(
        {n: v for n, v in nodes.items() if not is_product(precision, v[0])}, tokens, lambda name, op: part(name)
    )
    lines.append("  other, by part: " + ", ".join(f"{p} {us:.1f}" for p, us in by_part.items()))
    return lines


def fp32_built(export: Path, model) -> Path:
    """A folder of the export's files with the fp32 Loop graph as this tree's code writes it."""
    scratch = BUILD / "int8" / "fp32.onnx"
    scratch.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(build_onnx_model(model, "fp32"), scratch)
    return candidate_folder(export, "fp32", scratch, "model.onnx")


def profile_main(export: Path, model, schemes: list[str], sentences: int, threads: int, rounds: int,
                 baseline: Path | None = None, ops: bool = False) -> None:  # fmt: skip
    """The profile of `export`'s fp32 graph and of each int8 candidate (`export`: the export's own int8 graph),
    every batch run by each engine in turn, the yardstick (its ceilings of the model's FLOPs) before and after.
    `baseline`: an export of the same model by other code (e.g. main's), whose fp32 and int8 graphs are profiled
    first, in the same turns; the fp32 graph is then this tree's, built afresh. `ops`: each graph also without
    this project's kernels (`NAME-ops`: its own ops computed by their standard ops, as where none was built)."""
    runs = {}
    if baseline:
        runs = {"baseline-fp32": (baseline, "fp32", "auto"), "baseline-int8": (baseline, "int8", "auto")}
    runs["fp32"] = (fp32_built(export, model) if baseline else export, "fp32", "auto")
    for name in schemes:
        if name in EXPORT_GRAPHS:
            runs[name] = (export, "int8", EXPORT_GRAPHS[name])
        else:
            runs[name] = (build(name, export, model)[0], "int8", "auto")
    if ops:
        runs |= {f"{name}-ops": run for name, run in runs.items() if not name.startswith("baseline")}
    batches = bulk_batches(made_up_sentences(sentences, seed=1))
    tokens = rounds * sum(len(s) for batch in batches for s in batch)
    opt = model.options
    yardstick = Yardstick(threads)
    print("\n".join(yardstick.lines(opt)), flush=True)
    print(f"{sentences} made-up sentences x {rounds} rounds, {tokens} tokens (distinct within a round), "
          f"{len(batches)} batches a round, {threads} threads, every batch run by each engine in turn")  # fmt: skip
    engines = {name: profiled_engine(folder, precision, threads, graph=graph, kernels=not name.endswith("-ops"))
               for name, (folder, precision, graph) in runs.items()}  # fmt: skip
    # a warm-up round, left out: an engine's first call of each batch's shapes costs it 1.5-3x a later one (its
    # memory's first use, 490 MiB at full size), which a long bulk run pays once
    for batch in batches:
        for engine in engines.values():
            engine.run(batch)
    for _ in range(rounds):
        for batch in batches:
            for engine in engines.values():
                engine.run(batch)
    for name, engine in engines.items():
        print("\n".join(report(name, runs[name][1], node_times(engine, len(batches)), tokens)), flush=True)
    yardstick.finish()
    print("\n".join(yardstick.lines(opt)))


def measured_model(kind: str):
    """`--model`'s export folder (made once) and its biLM: the full-size or the smaller published shape with random
    weights, or the embedded default model."""
    if kind in ("full", "small"):
        folder = full_size_model(FULL_OPTIONS if kind == "full" else SMALL_OPTIONS)
        export, options, weights = folder / "onnx", folder / "options.json", folder / "weights.hdf5"
    else:
        from model_export.export import export_published

        options, weights = ROOT / "models/default/options.json", ROOT / "models/default/weights.hdf5"
        export = BUILD / "default" / "onnx"
        if not (export / "model_int8.onnx").exists():
            export_published(options, weights, export)
    return export, load_bilm(options, weights)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--model",
        default="full",
        choices=["full", "small", "default"],
        help="full: the 2x4096_512 shape, small: 2x1024_128 (random weights); default: the embedded",
    )
    parser.add_argument("--schemes", default=DEFAULT, help=f"comma-separated, of {[*SCHEMES, *QUANTIZER]}")
    parser.add_argument("--seconds", type=float, default=5.0, help="timed seconds per engine and figure")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batches", default="1,32,bulk", help='of 1, 32, bulk; "none": accuracy only')
    parser.add_argument("--profile", action="store_true", help="the node time a token around the products")
    parser.add_argument("--sentences", type=int, default=120, help="--profile: made-up sentences profiled")
    parser.add_argument("--rounds", type=int, default=2, help="--profile: passes over the sentences")
    parser.add_argument("--baseline", type=Path, help="also an export of the same model by other code")
    parser.add_argument(
        "--ops",
        action="store_true",
        help="--profile: each graph also without this project's kernels (their ops' standard ops)",
    )
    parser.add_argument("--made-up", type=int, default=0, help="the rates on this many made-up sentences")
    args = parser.parse_args()

    export, model = measured_model(args.model)
    if args.profile:
        schemes = PROFILED if args.schemes == DEFAULT else args.schemes.split(",")
        return profile_main(export, model, schemes, args.sentences, args.threads, args.rounds, args.baseline, args.ops)
    opt = model.options
    yardstick = Yardstick(args.threads)
    print("\n".join(yardstick.lines(opt)), flush=True)
    sentences = fixture_sentences()
    # --made-up: the rates on made-up sentences, every token distinct and the token cache off (each token costs its
    # char CNN, as bench.bulk's --made-up); else on the fixture sentences, the engines' token cache on
    cache = {"token_cache": 0} if args.made_up else {}
    fp32 = Engine(export, provider="cpu", intra_op_threads=args.threads, **cache)
    want_check, want_batch = fp32.run(CHECK_SENTENCES), fp32.run(sentences)
    print(f"model: {export.relative_to(ROOT)}; the export's own int8 graphs are {INT8} and, for VNNI, {INT8_VNNI}")
    print(f"{'candidate':<16}{'build s':>8}{'MB':>7}{'max abs':>9}{'cos L0':>10}{'cos >L0':>10}"
          f"{'batch: max abs':>16}{'cos L0':>10}{'cos >L0':>10}")  # fmt: skip
    print(f"{'fp32':<16}{'':>8}{(export / 'model.onnx').stat().st_size / 1e6:>7.1f}")
    engines = {"fp32": fp32}
    names = args.schemes.split(",") + (["baseline"] if args.baseline else [])
    for name in names:
        if name in EXPORT_GRAPHS or name == "baseline":  # as the export (or --baseline's) wrote it
            candidate, graph, seconds = (args.baseline, "auto", 0.0) if name == "baseline" else \
                (export, EXPORT_GRAPHS[name], 0.0)  # fmt: skip
        else:
            (candidate, seconds), graph = build(name, export, model), "model_int8.onnx"
        engine = Engine(candidate, provider="cpu", precision="int8", graph=graph, intra_op_threads=args.threads,
                        **cache)  # fmt: skip
        check, batch = errors(engine.run(CHECK_SENTENCES), want_check), errors(engine.run(sentences), want_batch)
        size = engine.graph.file.stat().st_size / 1e6
        print(
            f"{name:<16}{seconds:>8.1f}{size:>7.1f}{check['max_abs']:>9.4f}{check['cos_layer0']:>10.6f}"
            f"{check['cos_above0']:>10.6f}{batch['max_abs']:>16.4f}{batch['cos_layer0']:>10.6f}"
            f"{batch['cos_above0']:>10.6f}",
            flush=True,
        )
        engines[name] = engine
    print(f"tokens/s (x fp32), each batch run by every engine in turn, {args.seconds:g} s each, {args.threads} threads")
    measured = {}
    timed = made_up_sentences(args.made_up, seed=5) if args.made_up else sentences
    for kind in [] if args.batches == "none" else args.batches.split(","):
        batches = bulk_batches(timed) if args.made_up and kind == "bulk" else cut(timed, kind)
        rates = measured[kind] = in_turn({n: e.run for n, e in engines.items()}, batches, seconds=args.seconds)
        row = "  ".join(f"{name} {rate:.0f} ({rate / rates['fp32']:.2f}x)" for name, rate in rates.items())
        print(f"  {'bulk-like' if kind == 'bulk' else 'batch ' + kind}: {row}", flush=True)
    yardstick.finish()
    print("\n".join(yardstick.lines(opt)))
    print("fractions of each precision's ceiling (the mean of the start's and the end's):")
    for kind, rates in measured.items():
        row = "  ".join(
            f"{name} {yardstick.fraction('fp32' if name == 'fp32' else 'int8', opt, rate):.2f}"
            for name, rate in rates.items()
        )
        print(f"  {'bulk-like' if kind == 'bulk' else 'batch ' + kind}: {row}")


if __name__ == "__main__":
    main()
