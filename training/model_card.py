"""MODEL_CARD.md: what a finished elmo-train run wrote (its train_log.json) as a page to read beside the model:
the data and its licences, the architecture and size, the training, the held-out perplexity against a bigram
baseline."""

from __future__ import annotations

from pathlib import Path


def _sources_table(sources: dict | None) -> list[str]:
    if not sources:
        return []
    lines = ["", "| source | Debian packages (version) | licence | training tokens |", "|---|---|---|---|"]
    for name, s in sources.items():
        packages = ", ".join(f"{p} ({v})" for p, v in s["packages"].items())
        lines.append(f"| {name} | {packages} | {s['license']} | {s['train_tokens']:,} |")
    return lines


def _by_file_table(by_file: dict) -> list[str]:
    if not by_file:
        return []
    lines = ["", "By held-out file (zero initial state; Kneser-Ney bigram on the same text):", "",
             "| held out | tokens | biLM forward | biLM backward | bigram forward | bigram backward |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for name, f in by_file.items():
        b, k = f["bilm_zero_state"], f["kneser_ney_bigram"]
        lines.append(
            f"| {name} | {f['tokens']} | {b['forward']} | {b['backward']} | {k['forward']} | {k['backward']} |"
        )
    return lines


def _files(paths: list[str] | str) -> str:
    """A list of text files as a reader takes it in: several files of one folder as the folder and their names."""
    if isinstance(paths, str):  # "every 50th corpus line"
        return paths
    folders = {str(Path(p).parent) for p in paths}
    if len(paths) > 1 and len(folders) == 1:
        return f"{len(paths)} files in {folders.pop()}/ ({', '.join(Path(p).stem for p in paths)})"
    return ", ".join(paths)


def _seen_before(log: dict) -> str:
    seen = log.get("init_tokens_seen", 0)
    return f", which had been trained on {seen:,} words before" if seen else ""


def _length(log: dict) -> str:
    """How long the run was: its epochs, or the share of one epoch that its step budget covered."""
    if log["config"].get("steps") and log["steps"] == log["config"]["steps"]:
        share = log["tokens_seen"] / (log["train_tokens"] + log["train_sentences"])  # predictions in one epoch
        return f"a budget of {log['steps']} steps ({100 * share:.0f}% of one epoch)"
    if log.get("passes") is not None and log["passes"] < log["config"]["epochs"]:  # a pass shipped before the end
        return (
            f"{log['passes']} of the {log['config']['epochs']} epochs of its schedule (one learning-rate schedule "
            f"over all {log['config']['epochs']}; this model is the run after pass {log['passes']})"
        )
    return f"{log['config']['epochs']} epochs"


def model_card(log: dict, out_dir: Path, warmup_sentences: int) -> str:
    """MODEL_CARD.md from train_log.json's content and the sizes of the files in out_dir; warmup_sentences: at
    most this many training sentences made the warm initial state."""
    ppl = log["heldout_perplexity"]
    opt, cnn = log["options"], log["options"]["char_cnn"]

    def row(name: str, p: dict) -> str:
        return f"| {name} | {p['forward']} | {p['backward']} |"

    sizes = {
        name: (out_dir / name).stat().st_size for name in ("weights.hdf5", "softmax.hdf5") if (out_dir / name).exists()
    }
    lines = [
        "# Model card",
        "",
        log["description"] or "A biLM trained with elmo-train.",
        "",
        "## Data",
        f"- Training: {_files(log['corpus'])}: {log['train_sentences']:,} sentences, {log['train_tokens']:,} tokens.",
        f"- Held out: {_files(log['heldout'])}: {log['heldout_sentences']:,} sentences, "
        f"{log['heldout_tokens']:,} tokens.",
        f"- Output vocabulary: {log['vocab_size']} words including <S>, </S>, <UNK>; "
        f"covers {100 * log['vocab_coverage_heldout']:.1f}% of held-out tokens (the rest are predicted as <UNK>, "
        "but every word is read through its characters).",
        *([f"- Fine-tuned from: {log['init']}{_seen_before(log)}"] if log["init"] else []),
        *_sources_table(log.get("sources")),
        "",
        "## Architecture and size",
        f"- char-CNN: {cnn['embedding']['dim']}-dim char embeddings, filters {cnn['filters']}, "
        f"{cnn['n_highway']} highway layer(s), {cnn['activation']}.",
        f"- {opt['lstm']['n_layers']} biLSTM layers of {opt['lstm']['dim']} cells projected to "
        f"{opt['lstm']['projection_dim']}, cell clip {opt['lstm']['cell_clip']}, projection clip "
        f"{opt['lstm']['proj_clip']}, residual connection: {opt['lstm']['use_skip_connections']}.",
        f"- Output: {opt['lstm']['n_layers'] + 1} layers of {2 * opt['lstm']['projection_dim']} dims.",
        f"- Parameters: {log['parameters']['bilm']:,} in the biLM, {log['parameters']['softmax']:,} in the softmax. "
        + ", ".join(f"`{k}` {v / 1e6:.1f} MB" for k, v in sizes.items())
        + ".",
        "",
        "## Training",
        f"- {_length(log)}, {log['steps']} steps of at most {log['config']['batch_tokens']} tokens, "
        f"Adam (lr {log['config']['learning_rate']}, warm-up then cosine decay), dropout {log['config']['dropout']}, "
        f"gradient norm clipped at {log['config']['clip_norm']}.",
        f"- Training time: {log['train_seconds'] / 60:.1f} min on {log['machine']}"
        f" ({log.get('device', 'cpu')}, {log.get('precision', 'fp32')}).",
        "- Every sentence starts from the zero state (stateless), as the service runs it.",
        "",
        "## Held-out perplexity (lower is better)",
        "",
        "| model | forward | backward |",
        "|---|---|---|",
        row("this biLM, zero initial state", ppl["bilm_zero_state"]),
        row("this biLM, warm initial state", ppl["bilm_warm_state"]),
        row("Kneser-Ney bigram, same vocabulary", ppl["kneser_ney_bigram"]),
        "",
        f"Over {ppl['bilm_zero_state']['predictions']} predictions per direction (every word and the sentence end).",
        *_by_file_table(log.get("heldout_perplexity_by_file") or {}),
        "",
        "The warm state is the mean final LSTM state over "
        f"{min(warmup_sentences, log['train_sentences'])} training sentences (`elmo-export --initial-state warm`).",
        "",
        "![training curve](training_curve.png)",
        "",
    ]
    return "\n".join(lines)
