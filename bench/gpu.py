"""The GPU benchmark: every figure of the project's GPU goals from one command, into a folder.

    python -m bench.gpu [--provider cuda|cpu] [--model full|tiny] [--out build/bench/gpu]
                        [--batches 1,32,256,1024] [--seconds 3] [--precisions fp32,fp16]
                        [--cuda-graphs off,on] [--window W] [--allennlp PYTHON] [--no-torch]

On the full-size published architecture with random weights (exported once under build/bench/; `--window` exports
the window graphs with another window, into their own folder, to choose the window by measurement):

* placement: per graph file, the copies to and from the host in ONNX Runtime's optimized graph (Loop bodies
  included) and the nodes placed off the provider;
* parity: each precision (and CUDA-graphs setting) on the provider against the CPU provider's fp32 Loop graph on
  the fixture sentences (max abs error, min cosine), and batch independence on the device (a few sentences alone
  against the same sentences inside batches of 30 and 256);
* tokens/s at each batch size, the fixture sentences repeated in their order and cut from a length-sorted pool,
  per precision and CUDA-graphs setting; a lone 25-token sentence's latency (p50, p99) with the token cache off
  and warm;
* baselines in the same run on the same device: the project's PyTorch `BiLM` eager, and allennlp 2.10.1's
  `_ElmoBiLm` (bench/allennlp_baseline.py in its own environment, `--allennlp`; skipped with a note without it).

Writes OUT/gpu.json (everything) and OUT/gpu.md (the goals' table and the full grid), and prints the table.
Needs numpy, h5py, onnx, onnxruntime or onnxruntime-gpu, and torch (the baseline and the export): not the
service's web stack. With `--provider cpu --model tiny` it runs in seconds (tests/bench/test_gpu.py); there
`--cuda-graphs on` runs the engine's fixed per-bucket buffers without a capture.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

from bench.common import (
    BUILD,
    FULL_OPTIONS,
    TINY,
    fixture_sentences,
    full_size_model,
    onnx_folder,
    percentiles,
    start_server,
    tiny_model,
)
from model_export.export import torch_layers
from service.engine.canary import cosine_min, max_abs_error
from service.engine.packing import PackedRows
from service.engine.providers import choose_providers, cuda_options, nodes_off, placed_session
from service.engine.session import Engine
from service.manifest import read_manifest

ALLENNLP_SCRIPT = Path(__file__).resolve().parent / "allennlp_baseline.py"
COPY_OPS = ("MemcpyToHost", "MemcpyFromHost")
LONE_TOKENS = 25
INDEPENDENCE_BATCHES = (30, 256)
INDEPENDENCE_ROWS = (0, 3, 18)  # fixture sentences of 50, 3 and 53 tokens
# The goals of the GPU work (issue 31), on an H100 or H200: fractions of the yardstick, the same math as fast as
# torch runs it on the same device (the project's BiLM as one CUDA graph; on the CPU, eager).
GOALS = {
    "engine_vs_yardstick": 0.60,  # fp32 engine at >= 256 rows in flight, over the fp32 yardstick at those rows
    "reduced_vs_yardstick": 0.50,  # fp16 engine over the bf16 yardstick
    "vs_allennlp": 1.5,  # fp32 engine over allennlp's biLM on the same device, at every batch size
    "lone_vs_yardstick": 1.3,  # a lone 25-token sentence's p50 over the yardstick's batch 1 (at most)
    "bulk_vs_engine": 0.8,  # elmo-embed over the engine at max rows
    "service_vs_engine": 0.7,  # the service at 256 clients over the engine
    "padding_efficiency": 0.85,  # the sentences' positions over the positions computed, at >= 256 rows
    "cosine_reduced": 0.9999,  # min cosine of the reduced precision against fp32
    "parity_fp32": 1e-5,  # max abs error against the CPU provider's fp32
    "independence": 1e-5,  # max abs difference of a sentence alone and inside a batch
}
YARDSTICK_POSITIONS = 27  # B rows x 27 positions: 25 tokens and the boundaries, every one real
LONG_TAIL = {"median_tokens": 18, "sigma": 0.8, "max_tokens": 250}  # the long-tailed mix: lognormal lengths


# --- the model and the machine ---------------------------------------------------------------------------------


def model_paths(model: str, window: int | None) -> dict[str, Path]:
    """The exported folder and the published options + weights it came from."""
    if model == "tiny":
        return {"onnx": tiny_model(window), "options": TINY / "options.json", "weights": TINY / "lm_weights.hdf5"}
    folder = full_size_model(FULL_OPTIONS, window=window)
    onnx_dir = folder / onnx_folder("onnx", window)  # where full_size_model exports this window
    return {"onnx": onnx_dir, "options": folder / "options.json", "weights": folder / "weights.hdf5"}


def device_name(provider: str, device_id: int) -> str:
    """The GPU's name from nvidia-smi (torch's when nvidia-smi is missing), or "cpu"."""
    if provider != "cuda":
        return "cpu"
    try:
        names = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True, timeout=30
        ).stdout.splitlines()
        return names[device_id].strip()
    except (OSError, IndexError, subprocess.SubprocessError):
        import torch

        return torch.cuda.get_device_name(device_id) if torch.cuda.is_available() else "unknown GPU"


def host_cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()}, {os.cpu_count()} cores"
    except OSError:
        pass
    return f"{platform.processor() or 'unknown'}, {os.cpu_count()} cores"


def cpu_flags() -> str:
    """The vector instructions the CPU has that ONNX Runtime's kernels use (a CPU figure depends on them)."""
    try:
        flags = set(
            next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")).split()
        )
    except (OSError, StopIteration):
        return "flags unknown"
    have = [f for f in ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile") if f in flags]
    return " ".join(have) or "no AVX2"


# --- placement -------------------------------------------------------------------------------------------------


def op_counts(graph: onnx.GraphProto) -> Counter:
    """Op types of a graph and of every subgraph (a Loop's body, an If's branches)."""
    counts = Counter()
    for node in graph.node:
        counts[node.op_type] += 1
        for attr in node.attribute:
            for sub in ([attr.g] if attr.HasField("g") else []) + list(attr.graphs):
                counts += op_counts(sub)
    return counts


def placement(model_dir: Path, provider: str, device_id: int) -> dict[str, dict]:
    """For each graph file: the copies to and from the host that ONNX Runtime put in its optimized graph, and
    the nodes it placed off the provider, with the session options the engine uses."""
    names = choose_providers(provider)
    if names[0] == "CUDAExecutionProvider" and hasattr(ort, "preload_dlls"):  # as the engine does
        ort.preload_dlls()
    result = {}
    for graph in read_manifest(model_dir).graphs:
        if graph.precision == "int8" and names[0] == "CUDAExecutionProvider":
            continue  # written for the CPU's integer kernels; the engine refuses it on CUDA
        providers = list(names)
        if names[0] == "CUDAExecutionProvider":
            providers[0] = (names[0], cuda_options(device_id, False))
        with tempfile.TemporaryDirectory() as tmp:
            optimized = Path(tmp) / "optimized.onnx"
            options = ort.SessionOptions()
            options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
            options.enable_mem_pattern = False
            options.optimized_model_filepath = str(optimized)
            # the weights to a side file, so that a full-size graph never meets protobuf's 2 GiB limit
            options.add_session_config_entry("session.optimized_model_external_initializers_file_name", "w.bin")
            options.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1024")
            session, log = placed_session(graph.file, options, providers)
            started = session.get_providers()[0]  # ONNX Runtime falls back to the CPU when CUDA cannot start
            del session
            per_step = None
            try:
                optimized_graph = onnx.load(str(optimized), load_external_data=False).graph
                counts, error = op_counts(optimized_graph), None
                if graph.kind == "window":  # the optimized graph's nodes in the LSTM layers, per position
                    per_step = sum(node.name.startswith("lstm") for node in optimized_graph.node) / graph.window
            except Exception as err:  # no optimized model written: keep the placement, say why
                counts, error = None, f"{type(err).__name__}: {err}"
        off = nodes_off(log, names[0])
        result[graph.file.name] = {
            "kind": graph.kind,
            "precision": graph.precision,
            "window": graph.window,
            "provider": started,
            "memcpy_to_host": None if counts is None else counts["MemcpyToHost"],
            "memcpy_from_host": None if counts is None else counts["MemcpyFromHost"],
            "nodes": None if counts is None else sum(counts.values()),
            "nodes_per_window_step": per_step,  # both layers, both directions
            "nodes_off_provider": len(off),
            "off_provider": off[:50],
        }
        if error:
            result[graph.file.name]["error"] = error
    return result


# --- parity ----------------------------------------------------------------------------------------------------


def parity(engine: Engine, reference: list[np.ndarray], sentences: list[list[str]]) -> dict[str, float]:
    got = engine.run(sentences)
    return {"max_abs_error": max_abs_error(got, reference), "min_cosine": cosine_min(got, reference)}


def batch_independence(engine: Engine, sentences: list[list[str]]) -> dict:
    """Max abs difference of a few sentences run alone and the same sentences inside batches of 30 and 256
    (a late copy of each, so that it sits at another row)."""
    alone = {i: engine.run([sentences[i]])[0] for i in INDEPENDENCE_ROWS}
    result = {}
    for size in INDEPENDENCE_BATCHES:
        batch = cycle(sentences, size)
        got = engine.run(batch)
        diffs = []
        for i in INDEPENDENCE_ROWS:
            row = max(r for r in range(size) if r % len(sentences) == i)
            diffs.append(float(np.abs(got[row] - alone[i]).max()))
        result[f"batch_{size}"] = max(diffs)
    result["max_abs_diff"] = max(result.values())
    return result


# --- speed -----------------------------------------------------------------------------------------------------


def cycle(sentences: Sequence, rows: int) -> list:
    return [sentences[i % len(sentences)] for i in range(rows)]


def batches_of(sentences: list, batch: int, order: str) -> list[list]:
    """The batches a figure runs: in fixture order, the sentences repeated to a whole number of batches (at least
    all 30); length-sorted, at least two batches cut from a sorted pool of the repeated sentences."""
    if order == "fixture":
        pool = cycle(sentences, batch * max(1, -(-len(sentences) // batch)))
    else:
        pool = sorted(cycle(sentences, batch * max(2, -(-2 * len(sentences) // batch))), key=len)
    return [pool[i : i + batch] for i in range(0, len(pool), batch)]


def tokens_per_s(run: Callable, batches: list[list], seconds: float, warmup: int) -> float:
    """Run the first batch, then every batch `warmup` times, untimed (on CUDA each bucket's shapes are planned, and
    captured as a CUDA graph after a few runs, and the token cache settles); then the batches in turn, until at
    least `seconds` have passed."""
    run(batches[0])
    for _ in range(warmup):
        for batch in batches:
            run(batch)
    tokens, start = 0, time.perf_counter()
    for batch in itertools.cycle(batches):
        run(batch)
        tokens += sum(map(len, batch))
        if (elapsed := time.perf_counter() - start) >= seconds:
            return tokens / elapsed
    raise AssertionError("unreachable")


def latency_ms(run: Callable, sentence: list[str], seconds: float, min_runs: int = 20) -> dict[str, float]:
    for _ in range(5):
        run([sentence])
    times, start = [], time.perf_counter()
    while len(times) < min_runs or time.perf_counter() - start < seconds:
        t0 = time.perf_counter()
        run([sentence])
        times.append((time.perf_counter() - t0) * 1e3)
    return {**percentiles(times, (50, 99)), "runs": len(times)}


def lone_sentence(sentences: list[list[str]]) -> list[str]:
    """A 25-token sentence: the first one of the fixtures that long, cut to 25 tokens."""
    return next(s for s in sentences if len(s) >= LONE_TOKENS)[:LONE_TOKENS]


def throughput(
    run: Callable, sentences: list, batches: list[int], seconds: float, orders: Sequence[str], warmup: int
) -> dict:
    result = {}
    for order in orders:
        result[order] = {
            str(b): tokens_per_s(run, batches_of(sentences, b, order), seconds, warmup)
            for b in batches
            if order == "fixture" or b > 1  # one sentence per batch: the order changes nothing
        }
    return result


# --- the engine as the service and elmo-embed run it: rows packed and refilled -----------------------------------


def long_tailed(sentences: list[list[str]], count: int, seed: int = 0) -> list[list[str]]:
    """Sentences of lognormal lengths (median LONG_TAIL tokens, a long tail up to its max), words drawn from the
    fixture's: many short, a few very long, as real text comes."""
    rng = np.random.default_rng(seed)
    words = [w for s in sentences for w in s]
    lengths = rng.lognormal(np.log(LONG_TAIL["median_tokens"]), LONG_TAIL["sigma"], count)
    lengths = np.clip(lengths.astype(int), 1, LONG_TAIL["max_tokens"])
    return [[words[i] for i in rng.integers(0, len(words), n)] for n in lengths]


def packed(engine: Engine, sentences: list[list[str]], rows: int, seconds: float, warmup: int) -> dict:
    """The engine with `rows` rows in flight, the sentences streamed in (more waiting than a call starts, as the
    batcher keeps them): tokens/s over at least `seconds` after `warmup` calls, and the padding efficiency."""
    rows_in_flight, fed, tokens = PackedRows(engine, max_rows=rows), 0, 0

    def call() -> int:
        nonlocal fed
        while len(rows_in_flight.waiting) < 3 * rows:
            rows_in_flight.admit([sentences[fed % len(sentences)]], [fed])
            fed += 1
        return sum(s.length - 2 for s in rows_in_flight.step())

    for _ in range(warmup + 1):
        call()
    positions, computed, start = rows_in_flight.positions, rows_in_flight.computed, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds:
        tokens += call()
    efficiency = (rows_in_flight.positions - positions) / max(1, rows_in_flight.computed - computed)
    return {"tokens_per_s": tokens / elapsed, "padding_efficiency": efficiency}


def run_efficiency(engine: Engine, sentences: list[list[str]], batch: int) -> float:
    """Padding efficiency of one batch of `batch` sentences run whole by `engine.run` (rows sized for a few full
    calls, and the batch's end padding)."""
    engine.run(cycle(sentences, batch))
    return engine.run_efficiency


# --- the yardstick and the baselines ---------------------------------------------------------------------------


def yardstick(paths: dict[str, Path], device: str, rows: list[int], seconds: float, precisions: Sequence[str]) -> dict:
    """The same math as fast as torch runs it on `device`: the project's BiLM on B rows x YARDSTICK_POSITIONS
    positions (every one real), on CUDA captured as one CUDA graph (fp32 with TF32 off; bf16 autocast), on the CPU
    eager: tokens/s at each B, and B=1's ms per call."""
    import torch

    from model_export.weights import load_bilm
    from service.text.chars import sentence_char_ids

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    model = load_bilm(paths["options"], paths["weights"]).to(device).eval()
    sentence = ["word"] * (YARDSTICK_POSITIONS - 2)
    one = torch.from_numpy(sentence_char_ids(sentence, model.options.max_chars)).to(device)
    result = {"device": device, "kind": "one CUDA graph" if device.startswith("cuda") else "eager on the CPU"}
    for precision in precisions:
        figures = {}
        for b in rows:
            chars = one.unsqueeze(0).repeat(b, 1, 1)
            autocast = torch.autocast(device.split(":")[0], dtype=torch.bfloat16, enabled=precision == "bf16")
            with torch.inference_mode(), autocast:
                if device.startswith("cuda"):
                    stream = torch.cuda.Stream()
                    stream.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(stream):
                        for _ in range(3):
                            model(chars)
                    torch.cuda.current_stream().wait_stream(stream)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph):
                        model(chars)

                    def step(graph=graph):
                        graph.replay()
                        torch.cuda.synchronize()
                else:

                    def step(chars=chars):
                        model(chars)

                step()
                calls, start = 0, time.perf_counter()
                while (elapsed := time.perf_counter() - start) < seconds or calls < 3:
                    step()
                    calls += 1
            figures[str(b)] = {"tokens_per_s": calls * b * (YARDSTICK_POSITIONS - 2) / elapsed,
                               "ms_per_call": 1e3 * elapsed / calls}  # fmt: skip
        result[precision] = figures
    return result


# --- elmo-embed and the service ----------------------------------------------------------------------------------


def bulk(paths: dict[str, Path], provider: str, sentences: list[list[str]], count: int, args) -> dict:
    """elmo-embed's embed_file (the window graph on `provider`, as on a GPU) over `count` sentences."""
    from service.bulk import embed_file

    engine = Engine(paths["onnx"], provider=provider, graph="window", device_id=args.device_id,
                    intra_op_threads=args.threads)  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        text = Path(tmp) / "in.txt"
        text.write_text("".join(" ".join(s) + "\n" for s in cycle(sentences, count)))
        stats = embed_file(engine, text, Path(tmp) / "out.hdf5", batch_tokens=65536, progress=False)
    return {"sentences": stats["sentences"], "tokens_per_s": stats["tokens_per_s"], "seconds": stats["seconds"]}


def service(paths: dict[str, Path], provider: str, sentences: list[list[str]], clients: list[int], args) -> dict:
    """A real elmo-serve on `provider` (the window graph on CUDA), `clients` closed-loop one-sentence clients each
    for --seconds: tokens/s and p50 ms (bench/load.py's client)."""
    import asyncio

    from bench.load import load

    env = {"ELMO_PROVIDER": provider, "ELMO_INTRA_OP_THREADS": str(args.threads), "ELMO_LOG_LEVEL": "warning",
           "ELMO_DEVICE_ID": str(args.device_id)}  # fmt: skip
    result = {}
    server, base, _ = start_server(paths["onnx"], args.threads, env)
    try:
        for n in clients:
            r = asyncio.run(load(f"{base}/embed", sentences, n, args.seconds, "float", "none"))
            result[str(n)] = {"tokens_per_s": r["tokens_per_s"], "p50_ms": 1e3 * r["latency"].get("p50", 0),
                              "errors": r["errors"]}  # fmt: skip
    finally:
        server.terminate()
        server.wait(timeout=60)
    return result


# --- baselines -------------------------------------------------------------------------------------------------


def torch_runner(paths: dict[str, Path], device: str) -> Callable:
    """The project's PyTorch `BiLM`, eager, fp32 (no TF32) on `device`: sentences -> each one's layers."""
    import torch

    from model_export.weights import load_bilm

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    model = load_bilm(paths["options"], paths["weights"]).to(device).eval()
    return lambda sentences: torch_layers(model, sentences)


def allennlp(python: str, paths: dict[str, Path], sentences, batches, device: str, seconds: float) -> dict:
    """allennlp 2.10.1 in its own environment, one process per batch size, on the fixture sentences repeated
    (at least `seconds` of work at the measured speed is not known in advance: the input is sized to at least
    four batches and 600 sentences)."""
    result = {}
    with tempfile.TemporaryDirectory() as tmp:
        for batch in batches:
            text = Path(tmp) / f"batch{batch}.txt"
            rows = max(4 * batch, 600)
            text.write_text("\n".join(" ".join(s) for s in cycle(sentences, rows)) + "\n")
            command = [python, str(ALLENNLP_SCRIPT), "--options", str(paths["options"]), "--weights",
                       str(paths["weights"]), "--input", str(text), "--batch-size", str(batch), "--device", device,
                       "--warmup", "2", "--threads", str(os.cpu_count() or 1)]  # fmt: skip
            done = subprocess.run(command, capture_output=True, text=True, timeout=max(300, 20 * seconds))
            if done.returncode != 0:
                result[str(batch)] = {"error": done.stderr.strip().splitlines()[-5:]}
                continue
            report = json.loads(done.stdout.strip().splitlines()[-1])
            result[str(batch)] = report["tokens_per_s"]
    return result


# --- the run ---------------------------------------------------------------------------------------------------


def run_benchmark(args: argparse.Namespace) -> dict:
    provider = args.provider
    batches = [int(b) for b in args.batches.split(",")]
    precisions = args.precisions.split(",")
    sentences = fixture_sentences()
    warmup = 3 if provider == "cuda" else 0  # passes over a figure's batches before it is timed
    t0 = time.perf_counter()
    paths = model_paths(args.model, args.window)
    log(f"model {paths['onnx']} ready in {time.perf_counter() - t0:.1f} s")
    report = new_report(args, paths, sentences, batches, precisions, warmup)

    log("placement")
    report["placement"] = placement(paths["onnx"], provider, args.device_id)

    log("reference: the CPU provider's fp32 Loop graph")
    reference_engine = Engine(paths["onnx"], provider="cpu", graph="loop", intra_op_threads=args.threads)
    reference = reference_engine.run(sentences)
    del reference_engine

    rows = [int(r) for r in args.rows.split(",")]
    report["settings"]["rows"] = rows
    report["settings"]["long_tail"] = LONG_TAIL
    report["engines"] = {}
    for precision in precisions:
        for graphs_on in [s == "on" for s in args.cuda_graphs.split(",")]:
            name = f"{precision}, cuda graphs {'on' if graphs_on else 'off'}"
            log(name)
            entry = report["engines"][name] = {"precision": precision, "cuda_graphs": graphs_on}
            measure_engine(entry, args, paths, reference, sentences, batches, rows, warmup)

    report["baselines"] = {}
    run_baselines(report, args, paths, reference, sentences, batches, rows, warmup)
    report["figures"] = figures(report, batches)
    report["elapsed_s"] = round(time.perf_counter() - t0, 1)
    return report


def new_report(args: argparse.Namespace, paths: dict[str, Path], sentences, batches, precisions, warmup: int) -> dict:
    """What ran where, before any figure: the date, device, host, ONNX Runtime, the model and the settings."""
    manifest = read_manifest(paths["onnx"]).manifest
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": device_name(args.provider, args.device_id),
        "host": host_cpu(),
        "provider": args.provider,
        "onnxruntime": ort.__version__,
        "onnxruntime_providers": ort.get_available_providers(),
        "model": {
            "name": args.model,
            "folder": str(paths["onnx"]),
            "output_dim": manifest["output_dim"],
            "num_layers": manifest["num_layers"],
            "graphs": manifest["graphs"],
        },
        "sentences": {"count": len(sentences), "mean_tokens": sum(map(len, sentences)) / len(sentences)},
        "settings": {
            "batches": batches,
            "seconds": args.seconds,
            "precisions": precisions,
            "cuda_graphs": args.cuda_graphs.split(","),
            "threads": args.threads,
            "warmup_passes": warmup,
        },
        "goals": GOALS,
        "notes": [],
    }


def measure_engine(entry: dict, args, paths, reference, sentences, batches, rows, warmup: int) -> None:
    """One engine's figures (its precision and CUDA-graphs setting in `entry`) into `entry`: parity, batch
    independence, throughput, packed rows, padding efficiency and lone latency; or the error that stopped it."""
    try:
        engine = Engine(paths["onnx"], provider=args.provider, precision=entry["precision"], graph="window",
                        device_id=args.device_id, cuda_graphs=entry["cuda_graphs"], intra_op_threads=args.threads,
                        max_rows=max(*batches, *rows, *INDEPENDENCE_BATCHES))  # fmt: skip
    except Exception as err:  # e.g. a node off the GPU: record it, measure the rest
        entry["error"] = f"{type(err).__name__}: {err}"
        log(f"  {entry['error']}")
        return
    lone = lone_sentence(sentences)
    mixes = {"fixture": sentences, "long-tailed": long_tailed(sentences, 4000)}
    entry["graph"] = {"file": engine.graph.file.name, "kind": engine.graph.kind, "window": engine.window}
    entry["provider"] = engine.provider
    entry["parity_vs_cpu_fp32"] = parity(engine, reference, sentences)
    entry["batch_independence"] = batch_independence(engine, sentences)
    entry["tokens_per_s"] = throughput(engine.run, sentences, batches, args.seconds, ("fixture", "sorted"), warmup)
    entry["packed"] = {
        mix: {str(r): packed(engine, text, r, args.seconds, warmup) for r in rows} for mix, text in mixes.items()
    }
    entry["run_padding_efficiency"] = {str(b): run_efficiency(engine, sentences, b) for b in batches}
    calls = engine._window  # what the buckets of CUDA graphs hold on the device, and the host's pooled outputs
    entry["buffers"] = {"buckets": len(calls.bound), "device_bytes": calls.captured_bytes,
                        "host_pool_bytes": calls.pool.held_bytes}  # fmt: skip
    entry["lone_latency_ms"] = {"cache_warm": latency_ms(engine.run, lone, args.seconds)}
    engine.token_cache = type(engine.token_cache)(0)  # every token through the char-CNN again
    entry["lone_latency_ms"]["cache_off"] = latency_ms(engine.run, lone, args.seconds)
    log(f"  {json.dumps({k: entry[k] for k in ('parity_vs_cpu_fp32', 'tokens_per_s', 'packed')})}")


def run_baselines(report: dict, args, paths, reference, sentences, batches, rows, warmup: int) -> None:
    """elmo-embed, the service, the yardstick and the PyTorch and allennlp baselines, as the arguments ask."""
    provider, precisions = args.provider, report["settings"]["precisions"]
    device = "cpu" if provider == "cpu" else f"cuda:{args.device_id}"
    if args.bulk_sentences:
        log(f"elmo-embed, {args.bulk_sentences} sentences")
        report["bulk"] = bulk(paths, provider, sentences, args.bulk_sentences, args)
    if args.clients:
        log(f"the service, {args.clients} clients")
        report["service"] = service(paths, provider, sentences, [int(c) for c in args.clients.split(",")], args)
    if args.no_torch:
        report["notes"].append("PyTorch baseline and yardstick skipped (--no-torch)")
    else:
        log(f"the yardstick: the project's BiLM on {device}")
        reduced = ["bf16"] if any(p != "fp32" for p in precisions) else []
        report["yardstick"] = yardstick(paths, device, sorted({1, *batches, *rows}), args.seconds, ["fp32", *reduced])
        log(f"PyTorch BiLM eager on {device}")
        import torch

        torch.set_num_threads(args.threads or (os.cpu_count() or 1))
        run = torch_runner(paths, device)
        report["baselines"]["torch_eager"] = {
            "device": device,
            "torch": torch.__version__,
            "parity_vs_cpu_fp32": {"max_abs_error": max_abs_error(run(sentences), reference)},
            "tokens_per_s": throughput(run, sentences, batches, args.seconds, ("fixture",), warmup)["fixture"],
            "lone_latency_ms": latency_ms(run, lone_sentence(sentences), args.seconds),
        }
    if args.allennlp and Path(args.allennlp).exists():
        log(f"allennlp 2.10.1 _ElmoBiLm on {device}")
        report["baselines"]["allennlp"] = {
            "device": device,
            "python": args.allennlp,
            "tokens_per_s": allennlp(args.allennlp, paths, sentences, batches, device, args.seconds),
        }
    else:
        what = f"{args.allennlp} not found" if args.allennlp else "no --allennlp PYTHON given"
        report["notes"].append(f"allennlp baseline skipped: {what} (bench/allennlp_baseline.py says how to make one)")


def figures(report: dict, batches: list[int]) -> list[dict]:
    """The goals' table: each figure as a fraction of the yardstick or of the engine (the best CUDA-graphs setting
    where there is a choice), the padding efficiency, and the accuracy rows."""
    engines = [e for e in report["engines"].values() if "error" not in e]
    rows = report["settings"]["rows"]
    out = []

    def row(figure, value, goal, note=""):
        met = None
        if value is not None:
            bound = float(goal.split()[-1].rstrip("x"))
            met = value >= bound if goal.startswith(">=") else value <= bound
        out.append({"figure": figure, "value": value, "goal": goal, "met": met, "note": note})

    def best(precision, get):
        found = [(v, e) for e in engines if e["precision"] == precision and (v := get(e)) is not None]
        return max(found, key=lambda x: x[0]) if found else (None, None)

    speed_rows(report, batches, row, best)
    accuracy_rows(engines, rows, row)
    return out


def cuda_graphs(e) -> str:
    return "" if e is None else f"cuda graphs {'on' if e['cuda_graphs'] else 'off'}"


def speed_rows(report: dict, batches: list[int], row, best) -> None:
    """The goals' speed figures (`row` adds one; `best` finds the best engine of a precision by a figure): the
    engine over the yardstick and over allennlp, the lone sentence, elmo-embed and the service over the engine."""
    yard = report.get("yardstick", {})
    rows = report["settings"]["rows"]
    for r in rows:
        for precision, against in (("fp32", "fp32"), ("fp16", "bf16")):
            value, e = best(precision, lambda e, r=r: e.get("packed", {}).get("fixture", {}).get(str(r), {})
                            .get("tokens_per_s"))  # fmt: skip
            stick = yard.get(against, {}).get(str(r), {}).get("tokens_per_s")
            goal = GOALS["engine_vs_yardstick" if precision == "fp32" else "reduced_vs_yardstick"]
            if e is not None:
                note = f"{value:,.0f} vs {stick:,.0f} tokens/s, {cuda_graphs(e)}" if stick else "no yardstick run"
                row(f"{precision} engine, {r} rows in flight, over the {against} yardstick at {r} rows",
                    value / stick if stick else None, f">= {goal}", note)  # fmt: skip
    allen = report["baselines"].get("allennlp", {}).get("tokens_per_s", {})
    for b in batches:
        value, e = best("fp32", lambda e, b=b: e["tokens_per_s"]["fixture"].get(str(b)))
        theirs = allen.get(str(b)) if isinstance(allen.get(str(b)), float | int) else None
        if e is not None:
            row(
                f"fp32 engine over allennlp's biLM, batch {b}",
                value / theirs if theirs else None,
                f">= {GOALS['vs_allennlp']}",
                f"{value:,.0f} tokens/s" + ("" if theirs else ", allennlp not run"),
            )
    lone, e = best("fp32", lambda e: -e["lone_latency_ms"]["cache_off"]["p50"])
    one = yard.get("fp32", {}).get("1", {}).get("ms_per_call")
    if e is not None:
        row(
            "lone 25-token sentence p50 over the yardstick's batch 1",
            -lone / one if one else None,
            f"<= {GOALS['lone_vs_yardstick']}",
            f"{-lone:.2f} ms, {cuda_graphs(e)}",
        )
    top = str(max(rows))
    engine_top, _ = best("fp32", lambda e: e.get("packed", {}).get("fixture", {}).get(top, {}).get("tokens_per_s"))
    if "bulk" in report and engine_top:
        row(
            f"elmo-embed over the engine at {top} rows",
            report["bulk"]["tokens_per_s"] / engine_top,
            f">= {GOALS['bulk_vs_engine']}",
            f"{report['bulk']['tokens_per_s']:,.0f} tokens/s",
        )
    clients = report.get("service", {})
    engine_256, _ = best("fp32", lambda e: e.get("packed", {}).get("fixture", {}).get("256", {}).get("tokens_per_s"))
    if "256" in clients and engine_256:
        row(
            "the service at 256 clients over the engine at 256 rows",
            clients["256"]["tokens_per_s"] / engine_256,
            f">= {GOALS['service_vs_engine']}",
            f"{clients['256']['tokens_per_s']:,.0f} tokens/s",
        )


def accuracy_rows(engines: list[dict], rows: list[int], row) -> None:
    """The goals' padding and accuracy figures: padding efficiency, fp16's cosine, fp32's error and independence."""
    for r in rows:
        for mix in ("fixture", "long-tailed"):
            effs = [e["packed"][mix][str(r)]["padding_efficiency"] for e in engines if "packed" in e]
            if effs:
                row(
                    f"padding efficiency, {mix} mix, {r} rows in flight", min(effs), f">= {GOALS['padding_efficiency']}"
                )
    reduced = [e for e in engines if e["precision"] != "fp32"]
    if reduced:
        row(
            "fp16 min cosine vs the CPU's fp32",
            min(e["parity_vs_cpu_fp32"]["min_cosine"] for e in reduced),
            f">= {GOALS['cosine_reduced']}",
        )
    fp32 = [e for e in engines if e["precision"] == "fp32"]
    if fp32:
        row(
            "fp32 max abs error vs the CPU provider's fp32",
            max(e["parity_vs_cpu_fp32"]["max_abs_error"] for e in fp32),
            f"<= {GOALS['parity_fp32']:g}",
            "worst CUDA-graphs setting",
        )
        row(
            "fp32 batch independence (alone vs in 30 and 256), max abs diff",
            max(e["batch_independence"]["max_abs_diff"] for e in fp32),
            f"<= {GOALS['independence']:g}",
        )


# --- the report ------------------------------------------------------------------------------------------------


def fmt(value) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, str):
        return value
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    if 0.99 < value < 1:  # a cosine
        return f"{value:.7f}"
    if abs(value) >= 10:
        return f"{value:.1f}"
    if abs(value) >= 0.01 or value == 0:
        return f"{value:.4g}" if abs(value) < 1 else f"{value:.2f}"
    return f"{value:.2e}"


def markdown(report: dict) -> str:
    lines = [
        f"GPU benchmark: {report['device']}, provider {report['provider']}, onnxruntime {report['onnxruntime']}, "
        f"model {report['model']['name']} (output dim {report['model']['output_dim']}), {report['date']}",
        "",
        "| figure | measured | goal | met | note |",
        "|---|---|---|---|---|",
    ]
    for row in report["figures"]:
        met = {True: "yes", False: "no", None: "n/a"}[row["met"]]
        lines.append(f"| {row['figure']} | {fmt(row['value'])} | {row['goal']} | {met} | {row['note']} |")
    batches = [str(b) for b in report["settings"]["batches"]]
    lines += ["", "tokens/s by batch size:", "", "| path | " + " | ".join(batches) + " | lone 25 p50 / p99 ms |",
              "|---|" + "---|" * (len(batches) + 1)]  # fmt: skip
    for name, entry in report["engines"].items():
        if "error" in entry:
            lines.append(f"| {name} | {entry['error'][:120]} |" + " |" * len(batches))
            continue
        lone = entry["lone_latency_ms"]["cache_off"]
        for order in ("fixture", "sorted"):
            rates = entry["tokens_per_s"][order]
            label = f"ONNX Runtime {name}" + (", length-sorted" if order == "sorted" else "")
            latency = f"{lone['p50']:.2f} / {lone['p99']:.2f}" if order == "fixture" else ""
            lines.append(f"| {label} | " + " | ".join(fmt(rates.get(b)) for b in batches) + f" | {latency} |")
    if "torch_eager" in report["baselines"]:
        t = report["baselines"]["torch_eager"]
        lone = t["lone_latency_ms"]
        lines.append(f"| PyTorch BiLM eager ({t['device']}) | "
                     + " | ".join(fmt(t["tokens_per_s"].get(b)) for b in batches)
                     + f" | {lone['p50']:.2f} / {lone['p99']:.2f} |")  # fmt: skip
    if "allennlp" in report["baselines"]:
        a = report["baselines"]["allennlp"]["tokens_per_s"]
        cells = [fmt(a[b]) if isinstance(a.get(b), float | int) else "error" for b in batches]
        lines.append("| allennlp 2.10.1 _ElmoBiLm | " + " | ".join(cells) + " | |")
    rows = [str(r) for r in report["settings"]["rows"]]
    lines += [
        "",
        "the engine with rows in flight, packed and refilled (tokens/s; padding efficiency):",
        "",
        "| path | mix | " + " | ".join(f"{r} rows" for r in rows) + " |",
        "|---|---|" + "---|" * len(rows),
    ]
    for name, entry in report["engines"].items():
        for mix, by_rows in entry.get("packed", {}).items():
            cells = [f"{fmt(by_rows[r]['tokens_per_s'])}; {by_rows[r]['padding_efficiency']:.3f}" for r in rows]
            lines.append(f"| ONNX Runtime {name} | {mix} | " + " | ".join(cells) + " |")
    for precision, by_rows in {k: v for k, v in report.get("yardstick", {}).items() if k in ("fp32", "bf16")}.items():
        cells = [fmt(by_rows.get(r, {}).get("tokens_per_s")) for r in rows]
        lines.append(f"| yardstick {precision} ({report['yardstick']['kind']}) | every position real | "
                     + " | ".join(cells) + " |")  # fmt: skip
    for name, entry in report["engines"].items():
        if "buffers" in entry:
            b = entry["buffers"]
            lines.append(f"- ONNX Runtime {name}: {b['buckets']} captured buckets holding "
                         f"{b['device_bytes'] / 2**20:,.0f} MiB on the device; {b['host_pool_bytes'] / 2**20:,.0f} "
                         "MiB of pooled host memory for outputs")  # fmt: skip
    if "bulk" in report:
        lines += ["", f"elmo-embed: {fmt(report['bulk']['tokens_per_s'])} tokens/s over {report['bulk']['sentences']} "
                  f"sentences ({report['bulk']['seconds']:.1f} s)"]  # fmt: skip
    for n, r in report.get("service", {}).items():
        lines.append(f"- the service, {n} clients: {fmt(r['tokens_per_s'])} tokens/s, p50 {r['p50_ms']:.1f} ms, "
                     f"{r['errors']} errors")  # fmt: skip
    lines += ["", "placement (optimized graph):", "",
              "| graph | copies to host | copies from host | nodes off | nodes | nodes per window step |",
              "|---|---|---|---|---|---|"]  # fmt: skip
    for file, p in report["placement"].items():
        copies = [fmt(p["memcpy_to_host"]), fmt(p["memcpy_from_host"])]
        lines.append(f"| {file} | {' | '.join(copies)} | {p['nodes_off_provider']} | {fmt(p['nodes'])} | "
                     f"{fmt(p.get('nodes_per_window_step'))} |")  # fmt: skip
    lines += [""] + [f"- {note}" for note in report["notes"]]
    return "\n".join(lines).rstrip() + "\n"


_START = time.perf_counter()


def log(message: str) -> None:
    print(f"[bench.gpu {time.perf_counter() - _START:6.1f} s] {message}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--provider", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--model", choices=("full", "tiny"), default="full", help="tiny: the test fixture model")
    parser.add_argument("--out", type=Path, default=BUILD / "gpu")
    parser.add_argument("--batches", default="1,32,256,1024")
    parser.add_argument("--seconds", type=float, default=3.0, help="minimum timed seconds per figure")
    parser.add_argument("--precisions", default="fp32,fp16")
    parser.add_argument("--cuda-graphs", default="off,on", help="off, on or off,on")
    parser.add_argument("--window", type=int, help="export the window graphs with this window (own folder)")
    parser.add_argument("--allennlp", help="the python of allennlp 2.10.1's environment")
    parser.add_argument("--no-torch", action="store_true", help="skip the PyTorch yardstick and baseline")
    parser.add_argument("--rows", default="256,1024", help="rows in flight of the packed engine's figures")
    parser.add_argument("--bulk-sentences", type=int, default=6000, help="elmo-embed's figure (0: skip it)")
    parser.add_argument("--clients", default="1,32,256", help="the service's figures ('': skip them)")
    parser.add_argument("--device-id", type=int, default=0)
    parser.add_argument("--threads", type=int, default=0, help="intra-op threads (0: one per core)")
    args = parser.parse_args(argv)
    if not set(args.cuda_graphs.split(",")) <= {"off", "on"}:
        parser.error("--cuda-graphs takes off, on or off,on")

    report = run_benchmark(args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu.json").write_text(json.dumps(report, indent=2) + "\n")
    table = markdown(report)
    (args.out / "gpu.md").write_text(table)
    print(table)
    log(f"wrote {args.out / 'gpu.json'} and {args.out / 'gpu.md'} in {report['elapsed_s']} s")


if __name__ == "__main__":
    main()
