"""elmo-train, the training package's console script."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from training.trainer import DEVICES, PRECISIONS, train


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="elmo-train",
        description="Train a biLM (or fine-tune one with --init) on tokenized text: one sentence per line, tokens "
        "separated by spaces. Writes the published layout (options.json + weights.hdf5) and a model card. "
        "Rerunning the same command after an interruption resumes from OUT/checkpoint.pt.",
    )
    parser.add_argument("--corpus", nargs="+", required=True, type=Path, help="training text files")
    parser.add_argument("--out", required=True, type=Path, help="output folder (also holds the checkpoint)")
    parser.add_argument("--config", default="small", help="small, tiny, or a JSON file (see training/configs/)")
    parser.add_argument("--init", type=Path, help="fine-tune this model folder (options.json + weights.hdf5)")
    parser.add_argument("--epochs", type=int, help="number of epochs (default: the config's)")
    parser.add_argument(
        "--steps",
        type=int,
        help="a budget of optimizer steps in all, ending training inside an epoch (default: the config's steps, "
        "else epochs x batches); the learning-rate schedule spans it",
    )
    parser.add_argument("--heldout", nargs="+", type=Path, help="held-out text (default: every 50th corpus line)")
    parser.add_argument(
        "--threads", type=int, help="torch threads (default: all cores; 1 is faster on a machine busy with other work)"
    )
    parser.add_argument(
        "--device", choices=DEVICES, default="cpu", help="cpu (default), cuda, or auto: cuda when torch sees a GPU"
    )
    parser.add_argument(
        "--precision",
        choices=PRECISIONS,
        default="fp32",
        help="fp32 (default), or bf16: bfloat16 autocast for the matmuls, float32 weights and optimizer state",
    )
    parser.add_argument(
        "--batch-tokens",
        type=int,
        help="padded tokens per batch (default: the config's batch_tokens on the CPU, cuda_batch_tokens on a GPU); "
        "fixed when a run starts",
    )
    parser.add_argument(
        "--max-minutes",
        type=float,
        help="stop at a checkpoint after the first step that ends this many minutes after the start; the same "
        "command resumes",
    )
    parser.add_argument(
        "--stop-after-steps", type=int, help="stop at a checkpoint at this optimizer step (counted over the whole run)"
    )
    parser.add_argument(
        "--release-to",
        type=Path,
        help="after each finished pass, release it to this folder (evaluated, its card, log and curve; replacing "
        "the pass before): a folder small enough to commit, so that no finished pass is lost with the machine",
    )
    return parser


def train_main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    for flag in ("batch_tokens", "stop_after_steps", "steps"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be at least 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        log = train(
            args.corpus,
            args.out,
            args.config,
            args.init,
            args.epochs,
            args.heldout,
            device=args.device,
            precision=args.precision,
            batch_tokens=args.batch_tokens,
            max_minutes=args.max_minutes,
            stop_after_steps=args.stop_after_steps,
            steps=args.steps,
            release_to=args.release_to,
        )
    except (ValueError, OSError) as err:
        print(f"elmo-train: {err}", file=sys.stderr)
        return 1
    if not log["finished"]:
        print(
            f"stopped at step {log['step']} (epoch {log['epoch'] + 1}, batch {log['batch']}), checkpoint in "
            f"{args.out}: run the same command again to resume"
        )
        return 0
    ppl = log["heldout_perplexity"]["bilm_zero_state"]
    print(f"wrote {args.out}: held-out perplexity forward {ppl['forward']}, backward {ppl['backward']}")
    return 0


if __name__ == "__main__":
    sys.exit(train_main())
