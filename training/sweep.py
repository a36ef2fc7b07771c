"""Choose an architecture by held-out perplexity: train each candidate config for the same number of steps on the
same text, measure held-out perplexity per direction and the training rate, and keep the best.

    python -m training.sweep --corpus build/corpus-all/train/*.txt --heldout build/corpus-all/heldout/*.txt \
        --configs elmo-small elmo-small-wide --steps 300 --out build/sweep [--device cuda --precision bf16] \
        [--budget-minutes 15] [--max-minutes 2.5]

Each candidate is an ordinary elmo-train run in OUT/<config>/, stopped at a checkpoint after --steps (so the
winner continues from there: `elmo-train --out OUT/<winner> --epochs E` resumes it). Stopped within the
learning-rate warm-up (steps <= the config's warmup_steps), nothing the run did depends on its number of epochs
yet, so the winner's epochs can be chosen afterwards: with --budget-minutes, the number of whole epochs that fit
in that much training at the rate measured here. The held-out perplexity after a few hundred steps ranks
architectures by how fast they learn, which is what a fixed training budget rewards; it is not their final one.
Writes OUT/sweep.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

from model_export.options import BiLMOptions
from training.language_model import BiLanguageModel, TokenTable, perplexity
from training.trainer import (
    CHECKPOINT,
    TrainingConfig,
    load_config,
    make_batches,
    read_sentences,
    resolve_device,
    train,
)
from training.vocab import Vocabulary

HELDOUT_SENTENCES = 4000  # an even sample of the held-out text: enough to rank, quick to run


def _heldout_sample(paths: list[Path]) -> list[list[str]]:
    sentences = read_sentences(paths)
    return sentences[:: max(1, len(sentences) // HELDOUT_SENTENCES)][:HELDOUT_SENTENCES]


def evaluate_checkpoint(out_dir: Path, heldout: list[list[str]], device: torch.device) -> tuple[dict, int]:
    """Held-out perplexity per direction of the model in out_dir/checkpoint.pt (float32), and its biLM's size."""
    payload = torch.load(out_dir / CHECKPOINT, weights_only=False, map_location="cpu")
    vocab, options = Vocabulary(payload["vocab"]), BiLMOptions.from_dict(payload["options"])
    model = BiLanguageModel(options, len(vocab))
    model.load_state_dict(payload["model"])
    model.to(device)
    table = TokenTable(vocab, options.max_chars)
    ppl = perplexity(model, [table.encode(s) for s in heldout], table).as_dict()
    return ppl, sum(p.numel() for p in model.bilm.parameters())


def sweep(
    corpus: list[Path],
    heldout: list[Path],
    configs: list[str],
    out_root: Path,
    steps: int,
    device: str = "cpu",
    precision: str = "fp32",
    budget_minutes: float | None = None,
    max_minutes: float | None = None,
) -> dict:
    """max_minutes: each candidate also stops after this much time (whichever comes first: then they are compared
    at equal time, which is as fair for a fixed budget)."""
    out_root.mkdir(parents=True, exist_ok=True)
    sample = _heldout_sample(heldout)
    results = {}
    for config in configs:
        _, _, cfg = load_config(config)
        if steps > cfg.warmup_steps:
            print(f"sweep: {config}: {steps} steps go past its warm-up ({cfg.warmup_steps}), so its learning-rate "
                  "schedule already depends on its epochs", file=sys.stderr)  # fmt: skip
        out = out_root / config.removesuffix(".json").replace("/", "_")
        train(corpus, out, config, heldout=heldout, device=device, precision=precision, stop_after_steps=steps,
              max_minutes=max_minutes)  # fmt: skip
        payload = torch.load(out / CHECKPOINT, weights_only=False, map_location="cpu")
        state, saved = payload["state"], TrainingConfig.from_dict(payload["config"])
        ppl, n_params = evaluate_checkpoint(out, sample, resolve_device(device))
        results[config] = {
            "out": str(out),
            "steps": state["step"],
            "tokens": state["tokens"],
            "train_seconds": round(state["train_seconds"], 1),
            "tokens_per_second": round(state["tokens"] / max(state["train_seconds"], 1e-9)),
            "batch_tokens": saved.batch_tokens,
            "heldout_perplexity": ppl,
            "bilm_parameters": n_params,
        }
    best = min(results, key=lambda c: sum(results[c]["heldout_perplexity"][d] for d in ("forward", "backward")))
    summary = {"steps": steps, "device": device, "precision": precision, "heldout_sentences": len(sample),
               "results": results, "best": best}  # fmt: skip
    if budget_minutes is not None:
        r = results[best]
        rows = [line.split() for line in _lines(corpus)]
        steps_per_epoch = len(make_batches([[0] * (len(s) + 2) for s in rows], r["batch_tokens"]))
        seconds_per_step = r["train_seconds"] / max(r["steps"], 1)
        summary["budget_minutes"] = budget_minutes
        summary["steps_per_epoch"] = steps_per_epoch
        summary["epochs_in_budget"] = max(1, math.floor(budget_minutes * 60 / seconds_per_step / steps_per_epoch))
    (out_root / "sweep.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def _lines(paths: list[Path]):
    for path in paths:
        with Path(path).open(encoding="utf-8", errors="replace") as f:
            yield from (line for line in f if line.strip())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", nargs="+", required=True, type=Path)
    parser.add_argument("--heldout", nargs="+", required=True, type=Path)
    parser.add_argument("--configs", nargs="+", required=True)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--out", type=Path, default=Path("build/sweep"))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--budget-minutes", type=float, help="also say how many epochs of the best fit in this")
    parser.add_argument("--max-minutes", type=float, help="each candidate stops after this long, if not at --steps")
    args = parser.parse_args(argv)
    try:
        s = sweep(args.corpus, args.heldout, args.configs, args.out, args.steps, args.device, args.precision,
                  args.budget_minutes, args.max_minutes)  # fmt: skip
    except (ValueError, OSError) as err:
        print(f"sweep: {err}", file=sys.stderr)
        return 1
    print(f"| config | biLM parameters | held-out forward | backward | tokens/s ({s['device']}, {s['precision']}) |")
    print("|---|---|---|---|---|")
    for config, r in s["results"].items():
        p = r["heldout_perplexity"]
        rate = r["tokens_per_second"]
        print(f"| {config} | {r['bilm_parameters']:,} | {p['forward']} | {p['backward']} | {rate:,} |")
    fits = f"; {s['epochs_in_budget']} epochs fit in {s['budget_minutes']} minutes" if "budget_minutes" in s else ""
    print(f"after {s['steps']} steps; best: {s['best']}{fits}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
