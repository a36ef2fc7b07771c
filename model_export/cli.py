"""elmo-export, the build-time package's console script."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from model_export.export import INT8_VNNI_FILE, WINDOW, ExportError, export_manylangs, export_published
from model_export.manylangs import is_manylangs


def export_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="elmo-export",
        description="Export an ELMo to ONNX: a published-layout one (bilm-tf's: --options options.json --weights "
        "weights.hdf5, as allennlp's, bilm-tf's and NLPL's models come), or an ELMoForManyLangs folder (MODEL_DIR).",
    )
    parser.add_argument(
        "model_dir",
        nargs="?",
        help="a model folder: ELMoForManyLangs' (config.json, char.dic, word.dic, *.pkl), or one holding "
        "options.json and weights.hdf5",
    )
    parser.add_argument(
        "--format",
        choices=("auto", "bilm-tf", "elmoformanylangs"),
        default="auto",
        help="the layout of MODEL_DIR (default: told by its files)",
    )
    parser.add_argument("--options", help="options.json of a published-layout biLM")
    parser.add_argument("--weights", help="weights.hdf5 in the published ELMo layout")
    parser.add_argument("--out", required=True, help="folder for model.onnx and manifest.json")
    parser.add_argument(
        "--initial-state",
        choices=("zero", "warm"),
        default="zero",
        help="every sentence starts from the zero LSTM state (default), or from one fixed warm state: the mean "
        "final state over --warmup-text",
    )
    parser.add_argument("--warmup-text", help="tokenized text, one sentence per line (with --initial-state warm)")
    parser.add_argument(
        "--language",
        default="en",
        help="the language whose Moses rules (non-breaking prefixes) the service tokenizes text with (default en; "
        "an ELMoForManyLangs model's language, e.g. de); clients may always send tokens instead",
    )
    parser.add_argument(
        "--window", type=int, default=WINDOW, help=f"positions the GPU's window graph unrolls (default {WINDOW})"
    )
    args = parser.parse_args(argv)
    if (args.initial_state == "warm") != (args.warmup_text is not None):
        parser.error("--initial-state warm and --warmup-text FILE go together")
    if args.window < 1:
        parser.error("--window must be at least 1")
    from service.text.moses import LANGUAGES

    if args.language not in LANGUAGES:
        parser.error(f"--language {args.language!r}: Moses has rules for {', '.join(LANGUAGES)}")
    layout = _layout(parser, args)
    if layout == "elmoformanylangs" and args.warmup_text:
        parser.error("--initial-state warm is for published-layout models")
    try:
        if layout == "elmoformanylangs":
            manifest = export_manylangs(args.model_dir, args.out, window=args.window, language=args.language)
        else:
            manifest = export_published(
                args.options, args.weights, args.out, args.warmup_text, window=args.window, language=args.language
            )
    except (ExportError, ValueError, OSError) as err:
        print(f"elmo-export: {err}", file=sys.stderr)
        return 1
    parity = manifest["parity"]
    cost = {g["file"]: g["accuracy"] for g in manifest["graphs"] if "accuracy" in g}
    int8, vnni, fp16 = (cost.get(name, {}) for name in ("model_int8.onnx", INT8_VNNI_FILE, "model_window_fp16.onnx"))
    print(
        f"wrote {args.out}/model.onnx: {manifest['num_layers']} layers of {manifest['output_dim']}, "
        f"{manifest['initial_state']} initial state, "
        f"max abs error vs PyTorch {parity['max_abs_error']:.2e} (tolerance {parity['tolerance']:g}); "
        f"also model_int8.onnx (CPU, int8: max abs error to fp32 {int8['max_abs_error_vs_fp32']:.3g}, "
        f"min cosine {int8['min_cosine_vs_fp32']:.6f}), {INT8_VNNI_FILE} (CPU with VNNI or AMX, int8: max abs "
        f"error {vnni['max_abs_error_vs_fp32']:.3g}, min cosine {vnni['min_cosine_vs_fp32']:.6f}), "
        f"model_window.onnx (CUDA, window {args.window}), "
        f"model_window_fp16.onnx (min cosine to fp32 {fp16['min_cosine_vs_fp32']:.6f}) and "
        f"{len(manifest['canaries']['sentences'])} canary sentences"
    )
    return 0


def _layout(parser: argparse.ArgumentParser, args: argparse.Namespace) -> str:
    """bilm-tf or elmoformanylangs, from --format or MODEL_DIR's files; fills in --options/--weights from
    MODEL_DIR for a published-layout folder."""
    if args.model_dir is None:
        if not (args.options and args.weights):
            parser.error("give MODEL_DIR, or --options and --weights")
        if args.format == "elmoformanylangs":
            parser.error("--format elmoformanylangs needs MODEL_DIR")
        return "bilm-tf"
    if args.options or args.weights:
        parser.error("give MODEL_DIR or --options and --weights, not both")
    folder = Path(args.model_dir)
    layout = args.format
    if layout == "auto":
        layout = "elmoformanylangs" if is_manylangs(folder) else "bilm-tf"
    if layout == "bilm-tf":  # as published: options.json and weights.hdf5, or one *options*.json and *weights*.hdf5
        options = [folder / "options.json"] if (folder / "options.json").is_file() else [*folder.glob("*options*.json")]
        weights = [folder / "weights.hdf5"] if (folder / "weights.hdf5").is_file() else [*folder.glob("*weights*.hdf5")]
        if len(options) != 1 or len(weights) != 1:
            parser.error(
                f"{folder} is neither an ELMoForManyLangs folder (config.json, char.dic, token_embedder.pkl, "
                "encoder.pkl) nor one holding one *options*.json and one *weights*.hdf5: give --options and --weights"
            )
        args.options, args.weights = options[0], weights[0]
    return layout


if __name__ == "__main__":
    sys.exit(export_main())
