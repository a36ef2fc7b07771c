"""Console scripts of the run-time package: elmo-embed and elmo-serve."""

from __future__ import annotations

import argparse
import os
import socket
import sys

from service import __version__
from service.bulk import ALL_LINES, InputError, Output, Shard, embed_file
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
        description="Embed a file of sentences (.txt: one whitespace-tokenized sentence per line; "
        ".jsonl: one JSON list of tokens per line) into hdf5, one dataset per line. Takes allennlp 0.9's "
        "`allennlp elmo` flags with their meaning (docs/allennlp.md).",
    )
    parser.add_argument("--version", action="version", version=f"elmo-embed {__version__}")
    parser.add_argument(
        "--model", default=DEFAULT_MODEL_DIR, help="folder written by elmo-export (default: the embedded default model)"
    )
    parser.add_argument("input", help="input .txt or .jsonl")
    parser.add_argument("output", help="output .hdf5")
    parser.add_argument(
        "--batch-tokens",
        type=int,
        help="padded tokens per batch (default: 4096 on the CPU, 65536 on CUDA)",
    )
    parser.add_argument("--provider", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--threads", type=int, default=0, help="ONNX Runtime intra-op threads (0: one per core)")
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
    return parser


# allennlp batches --batch-size sentences whatever their length; the engine's batches are a budget of padded
# tokens. N sentences of up to 62 tokens (plus the two boundaries) fill N x 64: the same order of work per batch.
BATCH_SIZE_TOKENS = 64


def _embed_args(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """The command line, allennlp's flags turned into the engine's (provider, device, batch budget, model)."""
    args = parser.parse_args(argv)
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
    args.output_kind = Output(args.layers or "all", args.use_sentence_keys, args.forget_sentences)
    return args


def embed_main(argv: list[str] | None = None) -> int:
    args = _embed_args(_embed_parser(), argv)
    try:
        if args.options_file is not None:
            args.model = exported_model(args.options_file, args.weight_file)
        engine = Engine(
            args.model,
            provider=args.provider,
            intra_op_threads=args.threads,
            precision=args.precision,
            device_id=args.device_id,
            cuda_graphs=args.cuda_graphs,
        )
        verify_files(engine.info, engine.graph)  # every file it reads as exported (sha256), as elmo-serve checks
        report = canary.check(engine, canary.MARGIN)
        print(f"elmo-embed: {report.describe()}", file=sys.stderr)
        if report.checked and not report.passed and args.canary == "refuse":
            raise canary.CanaryMismatch("the canaries disagree (--canary warn embeds anyway)")
        batch_tokens = args.batch_tokens or default_batch_tokens(engine.provider)
        stats = embed_file(
            engine,
            args.input,
            args.output,
            batch_tokens,
            progress=not args.no_progress,
            shard=args.shard,
            output=args.output_kind,
            dtype=args.dtype,
            writer=args.writer,
        )
    except (InputError, FileNotFoundError, RuntimeError, ValueError, OSError) as err:
        print(f"elmo-embed: {err}", file=sys.stderr)
        return 1
    of_shard = f" of shard {args.shard}" if args.shard.count > 1 else ""
    print(
        f"embedded {stats['sentences']} sentences{of_shard}, {stats['tokens']} tokens in {stats['seconds']:.1f} s "
        f"({stats['tokens_per_s']:.0f} tokens/s) -> {args.output}",
        file=sys.stderr,
    )
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
