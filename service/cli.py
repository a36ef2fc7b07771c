"""Console scripts of the run-time package: elmo-embed and elmo-serve."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib.util
import json
import os
import signal
import socket
import sys
from pathlib import Path

from service import __version__
from service.bulk import ALL_LINES, InputError, Output, Shard, embed_file
from service.bulk.inputs import expand, split, whole_files
from service.bulk.parts import PART_LINES, Job, about, merge, part_lines, refuse
from service.engine import canary
from service.engine.session import Engine
from service.export_cache import exported_model
from service.logs import configure as configure_logs
from service.manifest import verify_files
from service.settings import DEFAULT_MODEL_DIR, default_batch_tokens


def _shard(text: str) -> Shard:
    try:
        return Shard.parse(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _embed_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="elmo-embed",
        description="Embed files of sentences (.txt: one whitespace-tokenized sentence per line; "
        ".jsonl: one JSON list of tokens per line) into hdf5, one dataset per line, or Parquet, a row per line; "
        "on this machine, or on a Ray cluster (--engine ray). Takes allennlp 0.9's `allennlp elmo` flags with "
        "their meaning (docs/allennlp.md). `elmo-embed merge PARTS... OUTPUT` joins --shard outputs.",
    )
    parser.add_argument("--version", action="version", version=f"elmo-embed {__version__}")
    parser.add_argument(
        "--model", default=DEFAULT_MODEL_DIR, help="folder written by elmo-export (default: the embedded default model)"
    )
    parser.add_argument("input", nargs="+", help="input .txt or .jsonl files, or globs; lines are counted from 0 "
                        "over all of them, in order")  # fmt: skip
    parser.add_argument("output", help="output .hdf5 file, or with --format parquet a folder")
    parser.add_argument("--format", default="hdf5", choices=["hdf5", "parquet"],
                        help="hdf5: allennlp's layout, one file (default); parquet: a folder of part files, a row "
                        "per line (pyarrow, pandas, DuckDB, Spark read it)")  # fmt: skip
    parser.add_argument("--skip-bad-lines", action="store_true",
                        help="a line that cannot be embedded (empty, not UTF-8, not a JSON list) is skipped and listed "
                        "in OUTPUT.bad-lines.jsonl, instead of stopping the run")  # fmt: skip
    _cluster_flags(parser)
    parser.add_argument(
        "--batch-tokens",
        type=int,
        help="padded tokens per batch (default: 4096 on the CPU, 65536 on CUDA)",
    )
    parser.add_argument("--provider", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--threads", type=int, help="ONNX Runtime intra-op threads (default 0: one per core; with "
                        "--engine ray, 1 an actor, and the CPUs each actor takes)")  # fmt: skip
    parser.add_argument(
        "--precision",
        default="fp32",
        choices=["fp32", "int8", "fp16"],
        help="fp32: exact (default); int8: the CPU's int8 graph; fp16: the reduced-precision window graph (CUDA)",
    )
    parser.add_argument(
        "--canary",
        default="refuse",
        choices=["refuse", "warn"],
        help="when the export's canary sentences disagree with the reference beyond the graph's allowance: stop "
        "(default), or warn and embed",
    )
    parser.add_argument("--device-id", type=int, default=0, help="the GPU to run on (CUDA device order)")
    parser.add_argument("--cuda-graphs", action="store_true", help="capture each batch shape as a CUDA graph")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "float16"],
        help="the datasets' type: float16 halves the file (each number rounded once; docs/gpu.md gives the error)",
    )
    parser.add_argument(
        "--writer",
        default="auto",
        choices=["auto", "process", "thread"],
        help="who writes the hdf5 file: a process of its own fed through shared memory, or a thread (the same file); "
        "auto: the process from 4 cores",
    )
    parser.add_argument(
        "--shard",
        type=_shard,
        default=ALL_LINES,
        metavar="I/N",
        help="embed only the lines k with k mod N == I (lines and I counted from 0), keeping their line indexes "
        "as keys: N jobs with --shard 0/N ... N-1/N cover the input exactly once",
    )
    _allennlp_flags(parser)
    return parser


def _allennlp_flags(parser: argparse.ArgumentParser) -> None:
    """allennlp 0.9's `allennlp elmo` flags, each with its meaning there (docs/allennlp.md)."""
    allennlp = parser.add_argument_group("allennlp 0.9's `elmo` command's flags, with its meaning")
    layers = allennlp.add_mutually_exclusive_group()
    layers.add_argument("--all", dest="layers", action="store_const", const="all", help="every layer (default)")
    layers.add_argument("--top", dest="layers", action="store_const", const="top", help="the top layer")
    layers.add_argument("--average", dest="layers", action="store_const", const="average", help="the layers' mean")
    allennlp.add_argument("--options-file", help="a published-layout options.json (with --weight-file): exported "
                          "once by elmo-export into a cache folder (ELMO_CACHE_DIR), instead of --model")  # fmt: skip
    allennlp.add_argument("--weight-file", help="the published-layout weights.hdf5 (with --options-file)")
    allennlp.add_argument("--batch-size", type=int, help=f"N sentences: --batch-tokens N x {BATCH_SIZE_TOKENS}")
    allennlp.add_argument("--cuda-device", type=int, help="N: the CUDA provider on device N; -1: the CPU")
    allennlp.add_argument("--forget-sentences", action="store_true", help="no sentence_to_index dataset")
    allennlp.add_argument("--use-sentence-keys", action="store_true",
                          help="each line's stripped text names its dataset (no sentence_to_index)")  # fmt: skip
    allennlp.add_argument("--file-friendly-logging", action="store_true", help="as --no-progress")
    allennlp.add_argument("--vocab-path", help="accepted and ignored, as allennlp 0.9 does")


def _cluster_flags(parser: argparse.ArgumentParser) -> None:
    """--engine ray's flags, and --resume and --part-lines of a run of parts (service/bulk/parts.py)."""
    cluster = parser.add_argument_group("on a Ray cluster (pip install 'elmo-service[ray]')")
    cluster.add_argument("--engine", default="local", choices=["local", "ray"],
                         help="local: this process (default); ray: a pool of Ray actors, an engine each")  # fmt: skip
    cluster.add_argument("--address", help="the Ray cluster: auto (the one this machine is part of) or HOST:PORT; "
                         "default: a local Ray, started and stopped by this run")  # fmt: skip
    cluster.add_argument("--actors", type=int, help="engines (Ray actors); default: as many as the cluster's CPUs "
                         "(or GPUs) allow")  # fmt: skip
    cluster.add_argument("--gpus-per-actor", type=float, default=0, help="GPUs each actor takes (default 0: the CPU)")
    cluster.add_argument("--resume", action="store_true", help="continue a run that was stopped: only the parts not "
                         "written whole are embedded again")  # fmt: skip
    cluster.add_argument("--part-lines", type=int, default=PART_LINES, help=f"lines a part at most (default "
                         f"{PART_LINES}): the unit of retry and of --resume")  # fmt: skip


# allennlp batches --batch-size sentences whatever their length; the engine's batches are a budget of padded
# tokens. N sentences of up to 62 tokens (plus the two boundaries) fill N x 64: the same order of work per batch.
BATCH_SIZE_TOKENS = 64


def _embed_args(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """The command line, allennlp's flags turned into the engine's (provider, device, batch budget, model)."""
    args = parser.parse_intermixed_args(argv)  # flags anywhere, between the inputs and after the output too
    if args.batch_size is not None:
        if args.batch_tokens is not None:
            parser.error("--batch-size and --batch-tokens both set the batch: give one")
        if args.batch_size < 1:
            parser.error("--batch-size must be at least 1")
        args.batch_tokens = args.batch_size * BATCH_SIZE_TOKENS
    if args.batch_tokens is not None and args.batch_tokens < 1:
        parser.error("--batch-tokens must be at least 1")
    if args.cuda_device is not None:
        if args.provider != "auto":
            parser.error("--cuda-device and --provider both choose the device: give one")
        args.provider, args.device_id = ("cpu", 0) if args.cuda_device < 0 else ("cuda", args.cuda_device)
    if (args.options_file is None) != (args.weight_file is None):
        parser.error("--options-file and --weight-file go together (or --model, a folder written by elmo-export)")
    args.no_progress = args.no_progress or args.file_friendly_logging
    if args.engine == "local":
        for flag, value in (("--address", args.address), ("--actors", args.actors),
                            ("--gpus-per-actor", args.gpus_per_actor)):  # fmt: skip
            if value:
                parser.error(f"{flag} is for --engine ray")
    else:
        if args.shard != ALL_LINES:
            parser.error("--shard is for --engine local: a Ray run splits the input into parts itself")
        if args.actors is not None and args.actors < 1:
            parser.error("--actors must be at least 1")
        if args.gpus_per_actor < 0:
            parser.error("--gpus-per-actor must be 0 or more")
    if args.threads is not None and args.threads < (0 if args.engine == "local" else 1):
        parser.error(f"--threads must be at least {0 if args.engine == 'local' else 1}")
    if args.part_lines < 1:
        parser.error("--part-lines must be at least 1")
    if args.format == "parquet" and (args.use_sentence_keys or args.forget_sentences):
        parser.error("--use-sentence-keys and --forget-sentences are hdf5's: Parquet has a sentence column")
    args.output_kind = Output(args.layers or "all", args.use_sentence_keys, args.forget_sentences, args.format)
    return args


def embed_main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["merge"]:
        return merge_main(argv[1:])
    args = _embed_args(_embed_parser(), argv)
    previous = signal.signal(signal.SIGTERM, _terminated)  # what Slurm, Kubernetes and `timeout` send
    jobs: list[Job] = []  # the job of parts, where the run has one (--engine ray, Parquet, --resume)
    try:
        inputs = expand(args.input)
        refuse(Path(args.output), args.format)  # before the model is loaded
        if args.options_file is not None:
            args.model = exported_model(args.options_file, args.weight_file)
        flags = {"layers": args.output_kind.layers, "sentence_keys": args.use_sentence_keys,
                 "forget_sentences": args.forget_sentences, "precision": args.precision,
                 "dtype": args.dtype}  # fmt: skip
        if args.shard.count > 1:
            flags["shard"] = str(args.shard)
        output = dataclasses.replace(args.output_kind, about=about(args.model, **flags))
        bad: list = []
        stats = (_embed_on_ray if args.engine == "ray" else _embed_here)(args, inputs, output, bad, jobs)
        for job in jobs:
            job.finish()
        if args.skip_bad_lines:
            _write_bad_lines(Path(f"{args.output}.bad-lines.jsonl"), bad)
    except (KeyboardInterrupt, _Terminated) as stop:
        name = "SIGINT" if isinstance(stop, KeyboardInterrupt) else "SIGTERM"
        if jobs:
            job = jobs[0]
            left = len(job.todo())
            kept = f"{len(job.parts) - left} of {len(job.parts)} parts kept in {job.folder}: the same command with " \
                   "--resume continues"  # fmt: skip
        else:
            kept = "nothing written"
        print(f"elmo-embed: stopped by {name}: {kept}", file=sys.stderr)
        return 130 if name == "SIGINT" else 143
    except (InputError, FileNotFoundError, RuntimeError, ValueError, OSError) as err:
        print(f"elmo-embed: {err}", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGTERM, previous)
        for job in jobs:
            job.close()
    of_shard = f" of shard {args.shard}" if args.shard.count > 1 else ""
    skipped = f", {len(bad)} bad lines skipped (-> {args.output}.bad-lines.jsonl)" if args.skip_bad_lines else ""
    print(
        f"embedded {stats['sentences']} sentences{of_shard}, {stats['tokens']} tokens in {stats['seconds']:.1f} s "
        f"({stats['tokens_per_s']:.0f} tokens/s){skipped} -> {args.output}",
        file=sys.stderr,
    )
    if args.engine == "ray":
        where = f"{stats['nodes']} nodes ({', '.join(stats['addresses'])})"
        print(f"elmo-embed: {stats['parts']} parts ({stats['parts_done_before']} written before), {stats['actors']} "
              f"actors on {where}; peak memory: driver {stats['driver_rss_mb']:.0f} MB, a worker "
              f"{stats['workers_rss_mb']:.0f} MB", file=sys.stderr)  # fmt: skip
    return 0


class _Terminated(BaseException):
    """SIGTERM, raised in the main thread as KeyboardInterrupt is for SIGINT: the run's cleanup runs either way."""


def _terminated(signum, frame) -> None:
    raise _Terminated


def _embed_here(args, inputs: list[str], output: Output, bad: list, jobs: list[Job]) -> dict:
    """This process's run: one output file straight from the pipeline, or (Parquet, --resume) the job's parts in
    turn."""
    engine = Engine(args.model, provider=args.provider, intra_op_threads=args.threads or 0, precision=args.precision,
                    device_id=args.device_id, cuda_graphs=args.cuda_graphs)  # fmt: skip
    verify_files(engine.info, engine.graph)  # every file it reads as exported (sha256), as elmo-serve checks
    report = canary.check(engine, canary.MARGIN)
    print(f"elmo-embed: {report.describe()}", file=sys.stderr)
    if report.checked and not report.passed and args.canary == "refuse":
        raise canary.CanaryMismatch("the canaries disagree (--canary warn embeds anyway)")
    batch_tokens = args.batch_tokens or default_batch_tokens(engine.provider)
    on_bad = (lambda *line: bad.append(line)) if args.skip_bad_lines else None
    run = functools.partial(embed_file, engine, batch_tokens=batch_tokens, progress=not args.no_progress,
                            shard=args.shard, output=output, dtype=args.dtype, writer=args.writer,
                            on_bad=on_bad)  # fmt: skip
    if output.format == "hdf5" and not args.resume:
        return run(whole_files(inputs), args.output)
    job = Job(Path(args.output), output.format, inputs, output.about, args.part_lines if args.resume else 1 << 62,
              args.resume)  # fmt: skip
    jobs.append(job)
    totals = {"sentences": 0, "tokens": 0, "seconds": 0.0}
    for part in job.todo():
        stamp = json.dumps({**json.loads(output.about), "part": part.index}, sort_keys=True)
        stats = run([part.span], job.path(part), output=dataclasses.replace(output, about=stamp))
        totals = {key: totals[key] + stats[key] for key in totals}
    return {**totals, "tokens_per_s": totals["tokens"] / max(totals["seconds"], 1e-9)}


def _embed_on_ray(args, inputs: list[str], output: Output, bad: list, jobs: list[Job]) -> dict:
    """The job's parts on a Ray cluster (service/bulk/on_ray.py), a part at most --part-lines lines, and at least
    four parts an actor."""
    from service.bulk import on_ray

    if importlib.util.find_spec("ray") is None:
        raise RuntimeError("--engine ray needs Ray: pip install 'elmo-service[ray]'")
    cluster = on_ray.Cluster(args.address, args.actors, args.threads or 1, args.gpus_per_actor)
    engine = on_ray.EngineArgs(str(args.model), args.provider, args.precision, args.device_id, args.cuda_graphs,
                               args.batch_tokens, args.canary)  # fmt: skip
    with on_ray.connected(cluster) as cluster:
        lines = sum(span.lines or 0 for span in split(inputs, 1 << 62))
        job = Job(Path(args.output), output.format, inputs, output.about,
                  part_lines(lines, cluster.actors, args.part_lines), args.resume)  # fmt: skip
        jobs.append(job)
        stats = on_ray.embed_on_ray(job, engine, output, args.dtype, cluster, args.skip_bad_lines,
                                    not args.no_progress)  # fmt: skip
    bad += stats["bad"]
    return stats


def _write_bad_lines(path: Path, bad: list) -> None:
    """The lines skipped (--skip-bad-lines), a JSON object a line: file, line number (from 1), line index, why."""
    with open(path, "w") as f:
        for file, number, index, reason in sorted(bad, key=lambda line: line[2]):
            f.write(json.dumps({"file": file, "line_number": number, "line": index, "reason": reason}) + "\n")


def merge_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="elmo-embed merge",
        description="Join the hdf5 outputs of `elmo-embed --shard I/N` runs into the one file an unsharded run "
        "writes (every dataset as it is, sentence_to_index joined). Refuses outputs of different models or flags, "
        "a set of shards that is not whole, or a line in two of them, naming them.",
    )
    parser.add_argument("parts", nargs="+", help="the shards' .hdf5 outputs (or globs)")
    parser.add_argument("output", help="the merged .hdf5")
    args = parser.parse_args(argv)
    try:
        parts = expand(args.parts)
        done = merge(parts, args.output)
    except (InputError, FileNotFoundError, OSError) as err:
        print(f"elmo-embed merge: {err}", file=sys.stderr)
        return 1
    print(f"merged {done['files']} files, {done['datasets']} datasets -> {args.output}", file=sys.stderr)
    return 0


def cannot_listen(host: str, port: int) -> OSError | None:
    """Why (host, port) cannot be listened on now, if it cannot: checked before the model is loaded."""
    if port == 0:
        return None
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does
            sock.bind(address)
    except OSError as err:
        return err
    return None


def serve_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="elmo-serve",
        description="Serve an exported model over HTTP. Every setting also comes from ELMO_* environment variables.",
    )
    parser.add_argument("--version", action="version", version=f"elmo-serve {__version__}")
    parser.add_argument("--model", help="folder written by elmo-export (default: the embedded default model)")
    parser.add_argument(
        "--models",
        metavar="NAME=DIR,...",
        help="several models, each with its own engine and queue; the first is the default (ELMO_MODELS)",
    )
    parser.add_argument("--host", help="default 127.0.0.1 (ELMO_HOST)")
    parser.add_argument("--port", type=int, help="default 8000 (ELMO_PORT)")
    args = parser.parse_args(argv)

    from pydantic import ValidationError

    from service.api.app import create_app, start_draining
    from service.manifest import read_manifest
    from service.server.serve import check_uvicorn, serve
    from service.settings import Settings, invalid_settings, unknown_variables

    given = {"model_dir": args.model, "models": args.models, "host": args.host, "port": args.port}
    overrides = {k: v for k, v in given.items() if v}
    for warning in unknown_variables(os.environ):
        print(f"elmo-serve: warning: {warning}", file=sys.stderr)
    try:
        settings = Settings(**overrides)
        for name, folder in settings.models:  # a clear message now, not a half-started server
            try:
                read_manifest(folder)
            except (FileNotFoundError, ValueError) as err:
                raise type(err)(f"model {name!r}: {err}") from None
    except ValidationError as err:  # before ValueError, which it is: one line per setting instead of pydantic's report
        for line in invalid_settings(err):
            print(f"elmo-serve: {line}", file=sys.stderr)
        return 1
    except (FileNotFoundError, ValueError) as err:
        print(f"elmo-serve: {err}", file=sys.stderr)
        return 1
    if err := cannot_listen(settings.host, settings.port):
        print(
            f"elmo-serve: cannot listen on {settings.host}:{settings.port} ({err.strerror or err}): "
            "choose another port with --port or ELMO_PORT (e.g. `ELMO_PORT=8001 make serve`)",
            file=sys.stderr,
        )
        return 1
    if settings.metrics_port is not None and (err := cannot_listen(settings.host, settings.metrics_port)):
        where = f"{settings.host}:{settings.metrics_port}"
        print(f"elmo-serve: cannot listen on {where} ({err.strerror or err}): choose another ELMO_METRICS_PORT",
              file=sys.stderr)  # fmt: skip
        return 1
    if problem := check_uvicorn():
        print(f"elmo-serve: {problem}", file=sys.stderr)
        return 1
    configure_logs(settings.log_level, settings.log_format)
    app = create_app(settings)
    # ELMO_METRICS_PORT is served in the same event loop, by the same bounded protocol (service/server/serve.py)
    return 0 if serve(app, settings, on_signal=lambda: start_draining(app), metrics=app.state.runtime.metrics) else 1


if __name__ == "__main__":
    sys.exit(embed_main())
