"""Training rate of candidate architectures on this machine: words per second of elmo-train's own step (forward,
backward, gradient clipping, Adam) on batches of real corpus sentences, per config and thread count.

    python -m bench.train_rate --corpus build/corpus-all/train/*.txt --configs small cpu-base cpu-wide \
        --threads 1 2 [--seconds 40] [--sentences 60000]

Every config runs the same sentences in the same batches (elmo-train's length-bucketed batches of the config's
batch_tokens, shuffled with one seed), from random weights, for --seconds after two warm-up steps. This ranks
architectures by cost; `python -m training.sweep` then ranks the affordable ones by held-out perplexity.
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

import torch

from training.language_model import BiLanguageModel, TokenTable, pad_batch
from training.trainer import load_config, make_batches, read_sentences
from training.vocab import Vocabulary


def sample_sentences(paths: list[Path], n: int, seed: int = 0) -> list[list[str]]:
    sentences = read_sentences(paths)
    return random.Random(seed).sample(sentences, min(n, len(sentences)))


def words_per_second(config: str, sentences: list[list[str]], threads: int, seconds: float) -> dict:
    """Train `config` from random weights on `sentences` for about `seconds`; words (predictions per direction)
    per second of the steps after the first two."""
    torch.set_num_threads(threads)
    _, options, cfg = load_config(config)
    torch.manual_seed(cfg.seed)
    vocab = Vocabulary.build(sentences, cfg.vocab_size, cfg.min_count)
    model = BiLanguageModel(options, len(vocab), cfg.dropout)
    model.train()
    table = TokenTable(vocab, options.max_chars)
    rows = [table.encode(s) for s in sentences]
    batches = make_batches(rows, cfg.batch_tokens)
    random.Random(cfg.seed).shuffle(batches)
    type_chars, type_targets = table.tensors()
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg.learning_rate)
    words, steps, started = 0, 0, None
    for n, batch in enumerate(batches):
        if n == 2:
            started = time.perf_counter()
        sums = model(pad_batch([rows[i] for i in batch]), type_chars, type_targets)
        loss = (sums.forward + sums.backward) / (2 * sums.predictions)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip_norm)
        optimizer.step()
        if started is not None:
            words += sums.predictions
            steps += 1
            if time.perf_counter() - started > seconds:
                break
    elapsed = time.perf_counter() - started
    return {
        "config": config,
        "threads": threads,
        "bilm_parameters": sum(p.numel() for p in model.bilm.parameters()),
        "output_dim": options.output_dim,
        "vocab": len(vocab),
        "batch_tokens": cfg.batch_tokens,
        "steps": steps,
        "words_per_second": words / elapsed,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", nargs="+", required=True, type=Path)
    parser.add_argument("--configs", nargs="+", required=True)
    parser.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--seconds", type=float, default=40.0)
    parser.add_argument("--sentences", type=int, default=60000)
    args = parser.parse_args(argv)
    sentences = sample_sentences(args.corpus, args.sentences)
    print(f"{len(sentences)} sentences ({sum(map(len, sentences))} words) sampled from {len(args.corpus)} files")
    print("| config | biLM parameters | output dim | vocab | threads | words/s |")
    print("|---|---|---|---|---|---|")
    for config in args.configs:
        for threads in args.threads:
            r = words_per_second(config, sentences, threads, args.seconds)
            print(
                f"| {config} | {r['bilm_parameters']:,} | {r['output_dim']} | {r['vocab']:,} | {threads} | "
                f"{r['words_per_second']:,.0f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
