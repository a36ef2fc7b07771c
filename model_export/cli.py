"""Console scripts of the build-time package: elmo-export."""

from __future__ import annotations

import argparse
import sys

from model_export.export import ExportError, export_published


def export_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="elmo-export", description="Export a published-layout ELMo (options.json + weights.hdf5) to ONNX."
    )
    parser.add_argument("--options", required=True, help="options.json of the biLM")
    parser.add_argument("--weights", required=True, help="weights.hdf5 in the published ELMo layout")
    parser.add_argument("--out", required=True, help="folder for model.onnx and manifest.json")
    args = parser.parse_args(argv)
    try:
        manifest = export_published(args.options, args.weights, args.out)
    except (ExportError, ValueError, OSError) as err:
        print(f"elmo-export: {err}", file=sys.stderr)
        return 1
    parity = manifest["parity"]
    print(
        f"wrote {args.out}/model.onnx: {manifest['num_layers']} layers of {manifest['output_dim']}, "
        f"max abs error vs PyTorch {parity['max_abs_error']:.2e} (tolerance {parity['tolerance']:g})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(export_main())
