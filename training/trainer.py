"""elmo-train: train (or fine-tune) a biLM on plain text and write it in the published layout.

corpus (one tokenized sentence per line) -> vocabulary (+ <UNK>) -> length-bucketed batches
-> BiLanguageModel: sum of the forward and backward log-likelihoods, dropout, Adam, gradient clipping
-> every epoch: held-out perplexity per direction; every few minutes: a checkpoint that a rerun resumes
   (on the CPU or a CUDA GPU, in float32 or with bfloat16 autocast; --max-minutes / --stop-after-steps end a
   run early at a checkpoint, so that a long run fits in several shorter calls)
-> out/: options.json + weights.hdf5 (what elmo-export and allennlp load), vocab.txt + softmax.hdf5 (for
   fine-tuning with --init), train_log.json, training_curve.png, MODEL_CARD.md
"""

from __future__ import annotations

import json
import math
import os
import platform
import random
import shutil
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

import h5py
import numpy as np
import torch
from tqdm import tqdm

from model_export.initial_state import mean_final_state
from model_export.options import BiLMOptions, load_options
from model_export.weights import load_published_weights, random_bilm, write_published_weights
from training.bigram import bigram_perplexities
from training.language_model import BiLanguageModel, Perplexity, TokenTable, pad_batch, perplexity
from training.model_card import model_card
from training.vocab import Vocabulary

CONFIGS = Path(__file__).with_name("configs")
CHECKPOINT = "checkpoint.pt"
PASSES = "passes"  # out/passes/N/: the model as it was after pass (epoch) N
PASS_STATE = "state.json"  # beside it: where the run stood then (steps, tokens, time, history)
# What a released pass is (`--release-to`, training.passes release --to): small enough to commit (about 15 MB for
# cpu-base), so that a finished pass outlives the machine it trained on. The softmax (2 MB in float16) comes along:
# without it the pass's perplexity cannot be measured, nor its training continued with its own softmax (--init).
# The checkpoint (the optimizer's state, 3x the weights) stays with the run.
RELEASED = (
    "options.json", "weights.hdf5", "softmax.hdf5", "vocab.txt", PASS_STATE, "train_log.json", "MODEL_CARD.md",
    "training_curve.png",
)  # fmt: skip
HELDOUT_EVERY = 50  # without --heldout, every 50th corpus line is held out
WARMUP_SENTENCES = 2000  # training sentences whose mean final state is the warm initial state measured here
DEVICES = ("auto", "cpu", "cuda")
# bf16, not fp16: bfloat16 keeps float32's 8-bit exponent, so gradients neither underflow nor overflow and no
# GradScaler is needed; an H100 (or any Ampere or later GPU) runs its matmuls at full tensor-core rate. Only the
# matmuls and convolutions run in bf16 under autocast; parameters, gradients and Adam's moments stay float32, so
# the exported weights.hdf5 is float32 in the published layout exactly as from an fp32 run.
PRECISIONS = ("fp32", "bf16")


def resolve_device(name: str) -> torch.device:
    """auto: cuda when torch sees a GPU, else cpu; cuda without one is an error (not a silent fallback)."""
    if name not in DEVICES:
        raise ValueError(f"--device {name}: choose one of {', '.join(DEVICES)}")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"--device cuda: this torch ({torch.__version__}) sees no CUDA GPU (torch.cuda.is_available() is "
            "False); use --device cpu, or --device auto to take a GPU only when there is one"
        )
    return torch.device(name)


@dataclass(frozen=True)
class TrainingConfig:
    vocab_size: int = 16000
    min_count: int = 1
    epochs: int = 5
    # A budget of optimizer steps in all, when one pass over the corpus is more than the time allows: training
    # stops there, the learning-rate schedule spans exactly these steps, and the batches are the first of the
    # (shuffled) epoch, so the words seen are a random sample of the corpus. None: epochs x batches per epoch.
    steps: int | None = None
    batch_tokens: int = 4096  # padded tokens per batch (<S> and </S> included), on the CPU
    cuda_batch_tokens: int = 32768  # the same on a GPU, which needs larger batches to be kept busy
    learning_rate: float = 2e-3
    warmup_steps: int = 200  # linear warm-up, then a cosine decay to a tenth
    dropout: float = 0.1
    clip_norm: float = 5.0
    seed: int = 0
    checkpoint_minutes: float = 5.0

    @classmethod
    def from_dict(cls, d: dict) -> TrainingConfig:
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown training settings: {', '.join(sorted(unknown))}")
        return cls(**d)


def load_config(name_or_path: str) -> tuple[str, BiLMOptions | None, TrainingConfig]:
    """`small`, `tiny` or a JSON file: {"options": <published options.json>, "training": {...}}, or a plain
    options.json (then the training settings are the defaults)."""
    path = CONFIGS / f"{name_or_path}.json" if (CONFIGS / f"{name_or_path}.json").exists() else Path(name_or_path)
    if not path.exists():
        raise ValueError(f"--config {name_or_path}: neither small, tiny nor a JSON file")
    data = json.loads(path.read_text())
    if "options" not in data and "lstm" in data:
        data = {"options": data}
    options = BiLMOptions.from_dict(data["options"]) if "options" in data else None
    return data.get("description", ""), options, TrainingConfig.from_dict(data.get("training", {}))


def read_sentences(paths: list[Path]) -> list[list[str]]:
    """Tokenized text: one sentence per line, tokens separated by whitespace; empty lines are skipped."""
    sentences = []
    for path in paths:
        with Path(path).open(encoding="utf-8", errors="replace") as f:
            sentences += [line.split() for line in f if line.strip()]
    return sentences


def make_batches(rows: list[np.ndarray], batch_tokens: int) -> list[list[int]]:
    """Indices of rows grouped by length, each group's padded size (rows x longest) within batch_tokens."""
    order = sorted(range(len(rows)), key=lambda i: len(rows[i]))
    batches, current, longest = [], [], 0
    for i in order:
        longest_if_added = max(longest, len(rows[i]))
        if current and longest_if_added * (len(current) + 1) > batch_tokens:
            batches.append(current)
            current, longest_if_added = [], len(rows[i])
        current.append(i)
        longest = longest_if_added
    if current:
        batches.append(current)
    return batches


def run_fingerprint(corpus: list[Path], heldout: list[Path] | None, init: Path | None, config: str) -> dict:
    """What a checkpoint must match to be resumed: the same text files (name and size), --init and --config."""

    def files(paths):
        return [[Path(p).name, Path(p).stat().st_size] for p in paths or []]

    return {"corpus": files(corpus), "heldout": files(heldout), "init": str(init) if init else None, "config": config}


def lr_factor(step: int, warmup: int, total: int) -> float:
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


class Trainer:
    def __init__(
        self,
        model: BiLanguageModel,
        vocab: Vocabulary,
        config: TrainingConfig,
        out_dir: Path,
        fingerprint: dict,
        precision: str = "fp32",
    ):
        self.model, self.vocab, self.config, self.out_dir = model, vocab, config, out_dir
        self.fingerprint = fingerprint  # which run a checkpoint belongs to
        self.device = next(model.parameters()).device
        if precision not in PRECISIONS:
            raise ValueError(f"--precision {precision}: choose one of {', '.join(PRECISIONS)}")
        self.precision = precision
        self.optimizer = torch.optim.Adam(model.parameters(), lr=config.learning_rate)
        self.state = {"epoch": 0, "batch": 0, "step": 0, "tokens": 0, "train_seconds": 0.0}
        self.history: dict[str, list] = {"loss": [], "epochs": []}
        self.stop_requested = False  # set by SIGTERM / SIGINT: stop after this step, at a checkpoint

    # -- checkpoints: everything needed to continue exactly where training stopped
    def save_checkpoint(self) -> None:
        payload = {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "state": self.state,
            "history": self.history,
            "vocab": self.vocab.words,
            "config": asdict(self.config),
            "options": self.model.bilm.options.to_dict(),
            "rng": torch.get_rng_state(),
            "cuda_rng": torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None,
            "fingerprint": self.fingerprint,
        }
        tmp = self.out_dir / (CHECKPOINT + ".tmp")
        torch.save(payload, tmp)
        os.replace(tmp, self.out_dir / CHECKPOINT)  # a kill mid-write leaves the previous checkpoint whole

    def load_checkpoint(self, payload: dict) -> None:
        self.model.load_state_dict(payload["model"])
        self.optimizer.load_state_dict(payload["optimizer"])
        self.state, self.history = payload["state"], payload["history"]
        torch.set_rng_state(payload["rng"])
        if self.device.type == "cuda" and payload.get("cuda_rng") is not None:
            torch.cuda.set_rng_state(payload["cuda_rng"], self.device)  # the same dropout masks on the same GPU

    def pass_state(self) -> dict:
        """Where the run stands at the end of a pass: what `finish_pass` needs besides the model."""
        keys = ("epoch", "step", "tokens", "train_seconds")
        return {key: self.state[key] for key in keys} | {"history": self.history, "config": asdict(self.config)}

    def autocast(self):
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.precision == "bf16")

    def fit(
        self,
        train_rows: list[np.ndarray],
        heldout_rows: list[np.ndarray],
        table: TokenTable,
        stop_after_steps: int | None = None,
        deadline: float | None = None,
        on_pass: Callable[[Path], None] | None = None,
    ) -> bool:
        """Train to the last epoch (True), or stop early at a checkpoint (False): at step stop_after_steps, or
        after the first step that ends past `deadline` (time.monotonic()). on_pass(OUT/passes/N) after each
        finished pass, once its folder is written."""
        cfg = self.config
        batches = make_batches(train_rows, cfg.batch_tokens)
        total_steps = min(cfg.steps or math.inf, cfg.epochs * len(batches))
        type_chars, type_targets = (t.to(self.device) for t in table.tensors())
        last_checkpoint = time.monotonic()

        def should_stop() -> bool:
            return (
                self.stop_requested
                or (stop_after_steps is not None and self.state["step"] >= stop_after_steps)
                or (deadline is not None and time.monotonic() > deadline)
            )

        while self.state["epoch"] < cfg.epochs and self.state["step"] < total_steps:
            if stop_after_steps is not None and self.state["step"] >= stop_after_steps:
                self.save_checkpoint()  # (a deadline is checked after each step: every call makes progress)
                return False
            epoch = self.state["epoch"]
            order = list(range(len(batches)))
            random.Random(cfg.seed * 1000 + epoch).shuffle(order)
            self.model.train()
            bar = tqdm(
                order[self.state["batch"] :], desc=f"epoch {epoch + 1}/{cfg.epochs}", unit="batch", mininterval=5
            )
            epoch_start, epoch_tokens = time.monotonic(), 0
            for b in bar:
                started = time.monotonic()
                self._step([train_rows[i] for i in batches[b]], type_chars, type_targets, total_steps)
                self.state["train_seconds"] += time.monotonic() - started
                epoch_tokens += sum(len(train_rows[i]) - 1 for i in batches[b])
                self.state["batch"] += 1
                loss = self.history["loss"][-1]["loss"]
                bar.set_postfix(
                    loss=f"{loss:.3f}", tok_s=f"{epoch_tokens / (time.monotonic() - epoch_start):.0f}", refresh=False
                )
                if time.monotonic() - last_checkpoint > cfg.checkpoint_minutes * 60:
                    self.save_checkpoint()
                    last_checkpoint = time.monotonic()
                if self.state["step"] >= total_steps:
                    break  # the step budget ends training inside this epoch
                if should_stop() and self.state["batch"] < len(batches):
                    bar.close()
                    self.save_checkpoint()
                    return False
            bar.close()
            ppl = perplexity(self.model, heldout_rows, table)
            self.history["epochs"].append(
                {"epoch": epoch + 1, "step": self.state["step"], "tokens": self.state["tokens"]} | ppl.as_dict()
            )
            print(
                f"epoch {epoch + 1}/{cfg.epochs}: held-out perplexity forward {ppl.forward:.1f}, "
                f"backward {ppl.backward:.1f} ({self.state['train_seconds'] / 60:.1f} min of training so far)",
                flush=True,
            )
            if self.state["batch"] >= len(batches):  # the epoch is over; a step budget that ended inside it
                self.state["epoch"] += 1  # leaves the position, so a rerun with a larger budget goes on from there
                self.state["batch"] = 0
                # Each finished pass is kept as a loadable model, so it can be measured while training goes on,
                # with where the run stood then, so it can be shipped as if the run had stopped there.
                folder = self.out_dir / PASSES / str(self.state["epoch"])
                write_model(self.model, self.vocab, folder)
                (folder / PASS_STATE).write_text(json.dumps(self.pass_state(), indent=1) + "\n")
                if on_pass is not None:
                    on_pass(folder)
            self.save_checkpoint()
            last_checkpoint = time.monotonic()
        return True

    def _step(self, rows: list[np.ndarray], type_chars, type_targets, total_steps: int) -> None:
        cfg = self.config
        for group in self.optimizer.param_groups:
            group["lr"] = cfg.learning_rate * lr_factor(self.state["step"], cfg.warmup_steps, total_steps)
        with self.autocast():
            sums = self.model(pad_batch(rows).to(self.device), type_chars, type_targets)
            loss = (sums.forward + sums.backward) / (2 * sums.predictions)  # mean of both directions' NLL per word
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.clip_norm)
        self.optimizer.step()
        self.state["step"] += 1
        self.state["tokens"] += sums.predictions
        if self.state["step"] % 10 == 1 or len(self.history["loss"]) == 0:
            self.history["loss"].append(
                {"step": self.state["step"], "tokens": self.state["tokens"], "loss": loss.item()}
            )


# -- the output folder


def write_model(model: BiLanguageModel, vocab: Vocabulary, out_dir: Path) -> None:
    """The published layout (options.json + weights.hdf5, what elmo-export and allennlp load) and what fine-tuning
    with --init reads besides (vocab.txt + softmax.hdf5)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "options.json").write_text(json.dumps(model.bilm.options.to_dict(), indent=2) + "\n")
    write_published_weights(model.bilm, out_dir / "weights.hdf5")
    write_softmax(model, out_dir / "softmax.hdf5")
    vocab.save(out_dir / "vocab.txt")


def write_softmax(model: BiLanguageModel, path: Path) -> None:
    # float16: only fine-tuning reads it (the published layout has no softmax), and it halves the file.
    with h5py.File(path, "w") as f:
        for name, value in model.softmax.state_dict().items():
            f.create_dataset(name, data=value.detach().cpu().numpy().astype(np.float16))


def can_continue_softmax(init_dir: Path) -> bool:
    return (init_dir / "softmax.hdf5").exists() and (init_dir / "vocab.txt").exists()


def init_from(model: BiLanguageModel, init_dir: Path) -> bool:
    """Fine-tuning: the biLM of init_dir and, when it has one (elmo-train's output), its softmax, which goes with
    its vocabulary. Returns whether the softmax was loaded."""
    load_published_weights(model.bilm, init_dir / "weights.hdf5")
    if not can_continue_softmax(init_dir):
        return False
    with h5py.File(init_dir / "softmax.hdf5", "r") as f:
        state = {name: torch.from_numpy(f[name][...].astype(np.float32)) for name in model.softmax.state_dict()}
    try:
        model.softmax.load_state_dict(state)
    except RuntimeError as err:  # shapes that do not match its options.json or vocab.txt
        raise ValueError(f"{init_dir / 'softmax.hdf5'} does not fit {init_dir / 'vocab.txt'}: {err}") from err
    return True


def plot_curve(history: dict, path: Path) -> None:
    try:
        import matplotlib
    except ImportError:  # a bare GPU machine: plot later from train_log.json's history (scripts/gpu-train.sh fetch)
        print(f"matplotlib is not installed: {path.name} not written", flush=True)
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_ppl) = plt.subplots(1, 2, figsize=(11, 4))
    tokens = np.array([h["tokens"] for h in history["loss"]]) / 1e6
    loss = np.array([h["loss"] for h in history["loss"]])
    if len(loss):
        window = max(1, len(loss) // 50)
        smooth = np.convolve(loss, np.ones(window) / window, mode="valid")
        ax_loss.plot(tokens, loss, alpha=0.3, label="per batch")
        ax_loss.plot(tokens[window - 1 :], smooth, label="moving mean")
        ax_loss.legend()
    ax_loss.set(xlabel="training words (millions)", ylabel="NLL per word (mean of both directions)", title="training")
    epochs = history["epochs"]
    x = [e["epoch"] for e in epochs]
    ax_ppl.plot(x, [e["forward"] for e in epochs], "o-", label="forward")
    ax_ppl.plot(x, [e["backward"] for e in epochs], "s-", label="backward")
    ax_ppl.set(xlabel="epoch", ylabel="perplexity", title="held-out perplexity", yscale="log")
    if epochs:
        ax_ppl.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def parameter_count(model: BiLanguageModel) -> dict[str, int]:
    bilm = sum(p.numel() for p in model.bilm.parameters())
    return {"bilm": bilm, "softmax": sum(p.numel() for p in model.softmax.parameters())}


@dataclass(frozen=True)
class Evaluation:
    zero: Perplexity
    warm: Perplexity
    bigram: dict[str, float]
    by_file: dict[str, dict]  # with several held-out files (one per source): each one's biLM and bigram figures


def evaluate(model, train_sentences, heldout_sets: dict[str, list], table, vocab) -> Evaluation:
    """Held-out perplexity from the zero and from the warm initial state, and the bigram baseline's; per held-out
    file too when there are several."""
    heldout_sentences = [s for sentences in heldout_sets.values() for s in sentences]
    heldout_rows = [table.encode(s) for s in heldout_sentences]
    model.bilm.set_initial_state(None)
    zero = perplexity(model, heldout_rows, table)
    warmup = train_sentences[:: max(1, len(train_sentences) // WARMUP_SENTENCES)][:WARMUP_SENTENCES]
    model.bilm.set_initial_state(mean_final_state(model.bilm, warmup))
    warm = perplexity(model, heldout_rows, table)
    model.bilm.set_initial_state(None)  # the written weights carry no state: elmo-export chooses
    sets = {"all": heldout_sentences, **(heldout_sets if len(heldout_sets) > 1 else {})}
    bigram = bigram_perplexities(vocab, train_sentences, sets)
    by_file = {
        name: {
            "bilm_zero_state": perplexity(model, [table.encode(s) for s in sentences], table).as_dict(),
            "kneser_ney_bigram": bigram[name],
            "tokens": sum(len(s) for s in sentences),
        }
        for name, sentences in heldout_sets.items()
        if len(heldout_sets) > 1 and sentences
    }
    return Evaluation(zero, warm, bigram["all"], by_file)


def train(
    corpus: list[Path],
    out_dir: Path,
    config: str = "small",
    init: Path | None = None,
    epochs: int | None = None,
    heldout: list[Path] | None = None,
    device: str = "cpu",
    precision: str = "fp32",
    batch_tokens: int | None = None,
    max_minutes: float | None = None,
    stop_after_steps: int | None = None,
    steps: int | None = None,
    release_to: Path | None = None,
) -> dict:
    """Train (or resume, or fine-tune from `init`) and write the output folder; returns train_log.json's content,
    or, when stopped early by max_minutes or stop_after_steps, {"finished": False, ...} with where it stopped (the
    checkpoint; the same call again resumes). With release_to, each finished pass is released there at once
    (`release_pass`), replacing the pass before it."""
    started = time.monotonic()
    torch_device = resolve_device(device)
    if precision not in PRECISIONS:
        raise ValueError(f"--precision {precision}: choose one of {', '.join(PRECISIONS)}")
    out_dir.mkdir(parents=True, exist_ok=True)
    description, options, cfg = _run_settings(config, init, epochs, steps)
    torch.manual_seed(cfg.seed)
    text = read_text(corpus, heldout)
    fingerprint = run_fingerprint(corpus, heldout, init, config)
    checkpoint = _read_checkpoint(out_dir, fingerprint)
    if checkpoint is not None:
        vocab, options, cfg = _resumed_settings(checkpoint, out_dir, epochs, steps, batch_tokens)
    else:  # a new run: its batch size is fixed now, by the device unless given
        vocab = _new_vocabulary(text, cfg, init)
        device_default = cfg.cuda_batch_tokens if torch_device.type == "cuda" else cfg.batch_tokens
        cfg = replace(cfg, batch_tokens=batch_tokens or device_default)
    trainer = _start_trainer(options, vocab, cfg, out_dir, fingerprint, precision, torch_device, init, checkpoint)
    table = TokenTable(vocab, options.max_chars)
    # the training rows first: the table numbers words in the order it meets them
    train_rows = [table.encode(s) for s in text.train]
    heldout_rows = [table.encode(s) for s in text.heldout]
    print(
        f"{len(text.train)} training sentences ({text.train_tokens} tokens), {len(text.heldout)} held out; "
        f"vocabulary {len(vocab)}; {cfg.epochs} epochs{f' or {cfg.steps} steps' if cfg.steps else ''}; "
        f"batches of {cfg.batch_tokens} tokens on {torch_device} "
        f"in {precision}",
        flush=True,
    )
    deadline = started + 60 * max_minutes if max_minutes is not None else None
    _stop_on_signals(trainer)

    def release(folder: Path) -> None:
        # The release builds and evaluates a model of its own: the run's random state must not move with it, or a
        # run with releases would draw other dropout masks than the same run resumed without them.
        with torch.random.fork_rng(devices=[]):
            state = json.loads((folder / PASS_STATE).read_text())
            release_pass(folder, corpus, heldout, config, state, release_to)
        print(f"pass {folder.name} released to {release_to}", flush=True)

    on_pass = release if release_to is not None else None
    if not trainer.fit(train_rows, heldout_rows, table, stop_after_steps, deadline, on_pass):
        state = trainer.state
        return {"finished": False, "out": str(out_dir)} | {k: state[k] for k in ("epoch", "batch", "step")}
    run = _Run(description, corpus, heldout, init, options, torch_device, precision)
    log = _finish(trainer, table, text, run)
    if release_to is not None and trainer.state["batch"] > 0:
        # A step budget ended the run inside a pass (an --init continuation, a --steps run): no pass folder was
        # written, and the finished run is what must outlive the machine; its state replaces the pass before's.
        (out_dir / PASS_STATE).write_text(json.dumps(trainer.pass_state(), indent=1) + "\n")
        copy_released(out_dir, release_to)
        print(f"the finished run released to {release_to}", flush=True)
    return log


def _run_settings(
    config: str, init: Path | None, epochs: int | None, steps: int | None
) -> tuple[str, BiLMOptions, TrainingConfig]:
    """The config's description, the architecture (--init's, when given) and the training settings, --epochs and
    --steps applied."""
    description, options, cfg = load_config(config)
    if epochs is not None:
        cfg = replace(cfg, epochs=epochs)
    if steps is not None:
        cfg = replace(cfg, steps=steps)
    if init is not None:
        options = load_options(init / "options.json")
    if options is None:
        raise ValueError(f"--config {config} has no architecture (options); give one or --init")
    return description, options, cfg


@dataclass(frozen=True)
class TrainingText:
    train: list[list[str]]
    heldout_sets: dict[str, list[list[str]]]  # by held-out file name, or {"heldout": every 50th corpus line}

    @property
    def heldout(self) -> list[list[str]]:
        return [s for sentences in self.heldout_sets.values() for s in sentences]

    @property
    def train_tokens(self) -> int:
        return sum(len(s) for s in self.train)


def read_text(corpus: list[Path], heldout: list[Path] | None) -> TrainingText:
    """The training and held-out sentences: the corpus and the --heldout files, or without them every 50th corpus
    line held out. A held-out file that is empty or shares another's name is refused before anything trains."""
    sentences = read_sentences(corpus)
    if heldout:
        read = {Path(p): read_sentences([p]) for p in heldout}
        if empty := [str(p) for p, v in read.items() if not v]:  # refused now, not in the evaluation at the end
            raise ValueError(f"held-out file with no sentences: {', '.join(empty)}")
        if len({p.stem for p in read}) < len(read):
            raise ValueError("held-out files are reported by name: give files of different names")
        text = TrainingText(sentences, {p.stem: v for p, v in read.items()})
    else:
        text = TrainingText(
            [s for i, s in enumerate(sentences) if i % HELDOUT_EVERY != HELDOUT_EVERY - 1],
            {"heldout": [s for i, s in enumerate(sentences) if i % HELDOUT_EVERY == HELDOUT_EVERY - 1]},
        )
    if not text.train or not text.heldout:
        raise ValueError("the corpus needs training and held-out sentences (give --heldout or more lines)")
    return text


def _read_checkpoint(out_dir: Path, fingerprint: dict) -> dict | None:
    """out_dir's checkpoint, if there is one; refused when it belongs to another run."""
    if not (out_dir / CHECKPOINT).exists():
        return None
    checkpoint = torch.load(out_dir / CHECKPOINT, weights_only=False, map_location="cpu")
    if checkpoint.get("fingerprint", fingerprint) != fingerprint:
        raise ValueError(
            f"{out_dir / CHECKPOINT} belongs to another run (its corpus, held-out text, --config or --init "
            "differ): choose another --out, or delete the checkpoint to start over"
        )
    return checkpoint


def _resumed_settings(
    checkpoint: dict, out_dir: Path, epochs: int | None, steps: int | None, batch_tokens: int | None
) -> tuple[Vocabulary, BiLMOptions, TrainingConfig]:
    """The vocabulary, architecture and settings a checkpoint was made with; more epochs or another step budget
    continue the run, other batches are refused."""
    vocab = Vocabulary(checkpoint["vocab"])
    options = BiLMOptions.from_dict(checkpoint["options"])
    saved = TrainingConfig.from_dict(checkpoint["config"])
    cfg = replace(saved, epochs=epochs) if epochs is not None else saved  # more epochs continue the run
    cfg = replace(cfg, steps=steps) if steps is not None else cfg  # so does another step budget
    if batch_tokens is not None and batch_tokens != saved.batch_tokens:
        raise ValueError(
            f"{out_dir / CHECKPOINT} was made with batches of {saved.batch_tokens} tokens: resume without "
            "--batch-tokens (the run keeps its batches on any device), or choose another --out"
        )
    return vocab, options, cfg


def _new_vocabulary(text: TrainingText, cfg: TrainingConfig, init: Path | None) -> Vocabulary:
    if init is not None and can_continue_softmax(init):
        return Vocabulary.load(init / "vocab.txt")  # new words are still read, through their characters
    return Vocabulary.build(text.train, cfg.vocab_size, cfg.min_count)


def _start_trainer(
    options: BiLMOptions,
    vocab: Vocabulary,
    cfg: TrainingConfig,
    out_dir: Path,
    fingerprint: dict,
    precision: str,
    device: torch.device,
    init: Path | None,
    checkpoint: dict | None,
) -> Trainer:
    """The model, new (random weights, or --init's) or as the checkpoint left it, on its device, with its
    optimizer."""
    model = BiLanguageModel(options, len(vocab), cfg.dropout)
    model.bilm.load_state_dict(random_bilm(options, seed=cfg.seed).state_dict())
    softmax_carried = init_from(model, init) if init is not None and checkpoint is None else False
    model.to(device)
    trainer = Trainer(model, vocab, cfg, out_dir, fingerprint, precision)
    if checkpoint is not None:
        trainer.load_checkpoint(checkpoint)
        print(
            f"resuming from {out_dir / CHECKPOINT}: epoch {trainer.state['epoch'] + 1}, batch {trainer.state['batch']}"
        )
    if init is not None and checkpoint is None:
        print(f"fine-tuning {init}: " + ("its softmax and vocabulary" if softmax_carried else "a new softmax"))
    return trainer


def _stop_on_signals(trainer: Trainer) -> None:
    """SIGTERM or SIGINT (Ctrl-C) stops the run at a checkpoint after the step in progress; a second one at once."""
    if threading.current_thread() is not threading.main_thread():  # signal handlers can only be set there
        return

    def request_stop(*_):
        if trainer.stop_requested:  # asked twice: stop now, losing at most checkpoint_minutes
            raise KeyboardInterrupt
        trainer.stop_requested = True
        print("stopping at a checkpoint after this step (again: stop now)", flush=True)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, request_stop)


@dataclass(frozen=True)
class _Run:
    """What the log says of a run besides its text and its trainer."""

    description: str
    corpus: list[Path]
    heldout: list[Path] | None
    init: Path | None
    options: BiLMOptions
    device: torch.device
    precision: str


def _finish(trainer: Trainer, table: TokenTable, text: TrainingText, run: _Run) -> dict:
    """A finished run's output folder: the evaluation, the model, the curve, train_log.json and MODEL_CARD.md;
    returns the log."""
    model, vocab, out_dir = trainer.model, trainer.vocab, trainer.out_dir
    model.eval()
    evaluation = evaluate(model, text.train, text.heldout_sets, table, vocab)
    write_model(model, vocab, out_dir)
    plot_curve(trainer.history, out_dir / "training_curve.png")
    log = _training_log(trainer, text, evaluation, run)
    (out_dir / "train_log.json").write_text(json.dumps(log, indent=1) + "\n")
    (out_dir / "MODEL_CARD.md").write_text(model_card(log, out_dir, WARMUP_SENTENCES))
    return log | {"finished": True}


def finish_pass(folder: Path, corpus: list[Path], heldout: list[Path] | None, config: str, state: dict) -> dict:
    """A pass of a run (OUT/passes/N/, and `state`: its PASS_STATE) as a finished run's output folder, in place:
    evaluated, with train_log.json, MODEL_CARD.md and training_curve.png, as if the run had been planned to stop
    there (the card says which pass of how many); returns the log. To ship a pass as the default model."""
    description, _, _ = load_config(config)
    cfg = TrainingConfig.from_dict(state["config"])
    options = load_options(folder / "options.json")
    vocab = Vocabulary.load(folder / "vocab.txt")
    text = read_text(corpus, heldout)
    model = BiLanguageModel(options, len(vocab), cfg.dropout)
    init_from(model, folder)
    trainer = Trainer(model, vocab, cfg, folder, {}, "fp32")
    trainer.state |= {key: state[key] for key in ("epoch", "step", "tokens", "train_seconds")}
    trainer.history = state["history"]
    run = _Run(description, corpus, heldout, None, options, torch.device("cpu"), "fp32")
    return _finish(trainer, TokenTable(vocab, options.max_chars), text, run)


def release_pass(
    folder: Path,
    corpus: list[Path],
    heldout: list[Path] | None,
    config: str,
    state: dict,
    to: Path | None = None,
    card: str = "",
) -> dict:
    """A finished pass (OUT/passes/N/) made a finished run's folder in place (`finish_pass`; `card`, a section added
    to its MODEL_CARD.md), then, with `to`, its RELEASED files copied there, replacing what is there: the folder a
    clean clone measures, ships or continues from (`elmo-train --init`). Returns the log."""
    log = finish_pass(folder, corpus, heldout, config, state)
    if card:
        with (folder / "MODEL_CARD.md").open("a") as f:
            f.write("\n" + card)
    if to is not None:
        copy_released(folder, to)
    return log


def copy_released(folder: Path, to: Path) -> None:
    """A released pass's files (RELEASED) copied from `folder` to `to`, replacing what is there."""
    to.mkdir(parents=True, exist_ok=True)
    for name in RELEASED:
        if (folder / name).exists():  # the curve needs matplotlib
            shutil.copyfile(folder / name, to / (name + ".tmp"))
            os.replace(to / (name + ".tmp"), to / name)  # each file whole, even if the copy is interrupted


def init_tokens_seen(init: Path | None) -> int:
    """The predictions an --init model was trained on before (its train_log.json's, its own --init's included;
    0 for a published model or none), so that a continuation's card counts all of its training."""
    log_path = Path(init) / "train_log.json" if init is not None else None
    if log_path is None or not log_path.exists():
        return 0
    log = json.loads(log_path.read_text())
    return log.get("tokens_seen", 0) + log.get("init_tokens_seen", 0)


def _training_log(trainer: Trainer, text: TrainingText, evaluation: Evaluation, run: _Run) -> dict:
    """train_log.json's content."""
    heldout_sentences = text.heldout
    return {
        "description": run.description,
        "corpus": [str(p) for p in run.corpus],
        "heldout": [str(p) for p in run.heldout] if run.heldout else f"every {HELDOUT_EVERY}th corpus line",
        "init": str(run.init) if run.init else None,
        "train_sentences": len(text.train),
        "train_tokens": text.train_tokens,
        "heldout_sentences": len(heldout_sentences),
        "heldout_tokens": sum(len(s) for s in heldout_sentences),
        "vocab_size": len(trainer.vocab),
        "vocab_coverage_heldout": round(
            sum(w in trainer.vocab.index for s in heldout_sentences for w in s)
            / sum(len(s) for s in heldout_sentences),
            4,
        ),
        "parameters": parameter_count(trainer.model),
        "config": asdict(trainer.config),
        "options": run.options.to_dict(),
        "train_seconds": round(trainer.state["train_seconds"], 1),
        "steps": trainer.state["step"],
        "passes": trainer.state["epoch"],  # finished passes over the corpus
        "tokens_seen": trainer.state["tokens"],  # predictions per direction: each word and each sentence end
        "init_tokens_seen": init_tokens_seen(run.init),  # what the --init model had seen before this run
        "machine": machine(run.device),
        "device": run.device.type,
        "precision": run.precision,
        "heldout_perplexity": {
            "bilm_zero_state": evaluation.zero.as_dict(),
            "bilm_warm_state": evaluation.warm.as_dict(),
            "kneser_ney_bigram": evaluation.bigram,
        },
        "heldout_perplexity_by_file": evaluation.by_file,
        "sources": corpus_sources(run.corpus),
        "history": trainer.history,
    }


def corpus_sources(corpus: list[Path]) -> dict | None:
    """The manifest of `python -m training.corpus --sources` beside the training files (its train/ folder's
    parent), if there is one: each source's package, licence and tokens go into the model card."""
    manifest = Path(corpus[0]).resolve().parent.parent / "manifest.json"
    if not manifest.exists():
        return None
    sources = json.loads(manifest.read_text())["sources"]
    return {
        name: {"packages": s["packages"], "license": s["license"], "train_tokens": s["train"]["tokens"]}
        for name, s in sources.items()
    }


def machine(device: torch.device) -> str:
    threads = torch.get_num_threads()
    where = (
        f"{platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
        f"{threads} thread{'s' if threads > 1 else ''}"
    )
    return f"{torch.cuda.get_device_name(device)}, {where}" if device.type == "cuda" else where
