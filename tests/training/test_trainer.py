"""elmo-train's runs (training.trainer): trains (the tiny config, seconds), resumes, fine-tunes, stops early
at a checkpoint, and writes files the loader and the exporter read back."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

import training.trainer as trainer_module
from model_export.export import torch_layers
from model_export.options import load_options
from model_export.weights import load_bilm
from tests.training.toy import WORDS, write_corpus
from training.language_model import BiLanguageModel
from training.trainer import Trainer, TrainingConfig, load_config, lr_factor, make_batches, train
from training.vocab import Vocabulary


def test_training_learns_the_toy_language(trained):
    _, log = trained
    ppl = log["heldout_perplexity"]
    unigram_vocab = len(WORDS) + 3  # uniform guessing over the vocabulary
    for direction in ("forward", "backward"):
        assert ppl["bilm_zero_state"][direction] < unigram_vocab / 3
        # The toy language is a bigram language, so the bigram baseline is near its entropy: the biLM gets close.
        assert ppl["bilm_zero_state"][direction] < 1.5 * ppl["kneser_ney_bigram"][direction]
    epochs = log["history"]["epochs"]
    assert [e["epoch"] for e in epochs] == [1, 2, 3]
    assert epochs[-1]["forward"] < epochs[0]["forward"]


def test_output_folder(trained):
    out, log = trained
    for name in ("options.json", "weights.hdf5", "vocab.txt", "softmax.hdf5", "MODEL_CARD.md", "train_log.json"):
        assert (out / name).stat().st_size > 0, name
    assert (out / "training_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    card = (out / "MODEL_CARD.md").read_text()
    assert "Held-out perplexity" in card and str(log["heldout_perplexity"]["bilm_zero_state"]["forward"]) in card
    vocab = Vocabulary.load(out / "vocab.txt")
    assert vocab.words[:3] == ["</S>", "<S>", "<UNK>"] and set(WORDS) <= set(vocab.words)


def test_each_finished_pass_is_kept_as_a_loadable_model(trained):
    """passes/N/ holds the model as it was after epoch N (measured while training goes on); the last one is the
    final model, bit for bit."""
    out, _ = trained
    assert sorted(p.name for p in (out / "passes").iterdir()) == ["1", "2", "3"]
    for name in ("options.json", "weights.hdf5", "vocab.txt", "softmax.hdf5"):
        assert (out / "passes" / "3" / name).read_bytes() == (out / name).read_bytes(), name
    with h5py.File(out / "passes" / "1" / "weights.hdf5") as first, h5py.File(out / "weights.hdf5") as last:
        name = "RNN_0/RNN/MultiRNNCell/Cell0/LSTMCell/W_0"
        assert not np.array_equal(first[name][...], last[name][...])  # pass 1 is not the trained model
    first = out / "passes" / "1"
    layers = torch_layers(load_bilm(first / "options.json", first / "weights.hdf5"), [["the", "cat", "sat"]])
    assert layers[0].shape[-1] == 2 * load_options(out / "options.json").proj_dim


def test_sigterm_stops_at_a_checkpoint_that_resumes(corpus, tmp_path):
    """The detached CPU run is stopped with SIGTERM (or Ctrl-C): the step in progress ends, a checkpoint is
    written, and the same command resumes from it."""
    script = "import sys; from training.cli import train_main; sys.exit(train_main())"
    args = [sys.executable, "-c", script, "--corpus", str(corpus), "--out", str(tmp_path / "m"), "--config", "tiny",
            "--epochs", "50"]  # fmt: skip
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 120
    while not (tmp_path / "m" / "passes" / "1").exists():  # the run is under way: a pass is done
        assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read() if proc.poll() else "slow"
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    output = proc.communicate(timeout=60)[0]
    assert proc.returncode == 0, output
    assert "stopping at a checkpoint" in output
    state = torch.load(tmp_path / "m" / "checkpoint.pt", weights_only=False)["state"]
    assert 1 <= state["epoch"] < 50 and not (tmp_path / "m" / "weights.hdf5").exists()
    resumed = train([corpus], tmp_path / "m", "tiny", stop_after_steps=state["step"] + 1)
    assert resumed["step"] == state["step"] + 1  # went on from the checkpoint, not from scratch


def test_written_weights_load_back_with_the_checkpoints_vectors(trained, tmp_path):
    """The published layout: our loader reads it back, and the same vectors come out of the checkpoint."""
    out, _ = trained
    bilm = load_bilm(out / "options.json", out / "weights.hdf5")
    checkpoint = torch.load(out / "checkpoint.pt", weights_only=False)
    model = BiLanguageModel(load_options(out / "options.json"), len(Vocabulary.load(out / "vocab.txt")))
    model.load_state_dict(checkpoint["model"])
    model.eval()
    sentences = [["the", "cat", "sat"], ["a", "big", "dog", "ran", "slowly"]]
    for a, b in zip(torch_layers(bilm, sentences), torch_layers(model.bilm, sentences), strict=True):
        np.testing.assert_array_equal(a, b)
    with h5py.File(out / "weights.hdf5") as f:
        assert "char_embed" in f and "RNN_1/RNN/MultiRNNCell/Cell1/LSTMCell/W_0" in f


@pytest.fixture(scope="module")
def dropout_config(tmp_path_factory) -> str:
    """tiny, with dropout (so the RNG state matters) and a checkpoint after every batch."""
    _, opt, cfg = load_config("tiny")
    path = tmp_path_factory.mktemp("config") / "tiny-dropout.json"
    training = asdict(replace(cfg, dropout=0.2, checkpoint_minutes=0.0))
    path.write_text(json.dumps({"options": opt.to_dict(), "training": training}))
    return str(path)


class Interrupted(Exception):
    pass


def test_resume_mid_epoch_gives_the_same_weights_as_an_uninterrupted_run(corpus, dropout_config, tmp_path, monkeypatch):
    """Killed after 30 steps (mid-epoch 2), rerun: the same batches, dropout masks and optimizer state, so the
    same final weights, bit for bit, as one run from start to end."""
    straight = train([corpus], tmp_path / "straight", dropout_config, epochs=2)
    real_step = Trainer._step

    def step_then_fail(self, *args):
        if self.state["step"] == 30:
            raise Interrupted
        real_step(self, *args)

    monkeypatch.setattr(Trainer, "_step", step_then_fail)
    with pytest.raises(Interrupted):
        train([corpus], tmp_path / "resumed", dropout_config, epochs=2)
    monkeypatch.setattr(Trainer, "_step", real_step)
    resumed = train([corpus], tmp_path / "resumed", dropout_config)  # the same command, the epochs from the checkpoint
    assert resumed["steps"] == straight["steps"] > 30
    assert resumed["history"]["epochs"] == straight["history"]["epochs"]
    with h5py.File(tmp_path / "straight" / "weights.hdf5") as a, h5py.File(tmp_path / "resumed" / "weights.hdf5") as b:
        for name in ("CNN_proj/W_proj", "RNN_0/RNN/MultiRNNCell/Cell1/LSTMCell/W_0"):
            np.testing.assert_array_equal(a[name][...], b[name][...])


def test_each_pass_is_released_at_once_and_the_release_moves_no_random_state(corpus, dropout_config, tmp_path):
    """--release-to: after each pass the folder holds that pass, evaluated (card, log), and nothing else of the run
    (no checkpoint); the latest pass replaces the one before. The release builds and evaluates a model of its own,
    yet the run draws the same dropout masks: its weights equal, bit for bit, those of the same run without it."""
    released = []
    real_release = trainer_module.release_pass

    def spy(folder, *args):
        log = real_release(folder, *args)
        card = (tmp_path / "released" / "MODEL_CARD.md").read_text()
        released.append((folder.name, json.loads((tmp_path / "released" / "train_log.json").read_text()), card))
        return log

    plain = train([corpus], tmp_path / "plain", dropout_config, epochs=2)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(trainer_module, "release_pass", spy)
        run = train([corpus], tmp_path / "run", dropout_config, epochs=2, release_to=tmp_path / "released")
    assert [name for name, _, _ in released] == ["1", "2"]
    assert [log["passes"] for _, log, _ in released] == [1, 2]
    assert released[0][1]["steps"] == run["history"]["epochs"][0]["step"]
    assert "1 of the 2 epochs of its schedule" in released[0][2]
    folder = tmp_path / "released"
    assert sorted(p.name for p in folder.iterdir()) == sorted(trainer_module.RELEASED)
    with h5py.File(tmp_path / "plain" / "weights.hdf5") as a, h5py.File(folder / "weights.hdf5") as b:
        for name in ("CNN_proj/W_proj", "RNN_1/RNN/MultiRNNCell/Cell1/LSTMCell/W_0"):
            np.testing.assert_array_equal(a[name][...], b[name][...])
    assert run["history"]["epochs"] == plain["history"]["epochs"]


def test_a_run_ended_by_its_step_budget_inside_a_pass_is_released_as_a_whole(corpus, trained, tmp_path):
    """A continuation from a released pass (--init, a --steps budget inside the first epoch) writes no pass
    folder; the finished run itself is released, its state.json replacing the pass before's, so it outlives the
    machine like a pass does."""
    base, _ = trained
    folder = tmp_path / "released"
    folder.mkdir()
    (folder / "state.json").write_text('{"step": 999999}')  # the pass before's
    run = train([corpus], tmp_path / "run", "tiny", init=base, steps=3, release_to=folder)
    assert run["steps"] == 3
    assert not (tmp_path / "run" / "passes").exists()
    assert sorted(p.name for p in folder.iterdir()) == sorted(trainer_module.RELEASED)
    assert json.loads((folder / "state.json").read_text())["step"] == 3
    assert json.loads((folder / "train_log.json").read_text())["steps"] == 3
    with h5py.File(tmp_path / "run" / "weights.hdf5") as a, h5py.File(folder / "weights.hdf5") as b:
        np.testing.assert_array_equal(a["CNN_proj/W_proj"][...], b["CNN_proj/W_proj"][...])


def test_rerunning_a_finished_run_trains_no_more(corpus, trained, monkeypatch):
    out, log = trained
    monkeypatch.setattr(Trainer, "_step", lambda *a: pytest.fail("a finished run trained again"))
    again = train([corpus], out, "tiny", epochs=3)
    assert again["steps"] == log["steps"]
    assert again["heldout_perplexity"]["bilm_zero_state"] == log["heldout_perplexity"]["bilm_zero_state"]


def test_a_checkpoint_of_another_run_is_refused(trained, tmp_path):
    out, _ = trained
    other = write_corpus(tmp_path / "other.txt", 300, seed=1)
    with pytest.raises(ValueError, match="belongs to another run"):
        train([other], out, "tiny", epochs=3)


def test_fine_tuning_continues_the_model_and_adapts_to_new_text(corpus, trained, tmp_path):
    """--init loads the biLM, the softmax and the vocabulary: before any step the model already knows the toy
    language (so it was loaded, not made anew); an epoch on text of another word order lowers that text's
    held-out perplexity."""
    base, _ = trained
    toy_held = write_corpus(tmp_path / "toy-held.txt", 40, seed=2)
    loaded = train([corpus], tmp_path / "loaded", "tiny", init=base, epochs=0, heldout=[toy_held])
    assert loaded["heldout_perplexity"]["bilm_zero_state"]["forward"] < (len(WORDS) + 3) / 3
    shifted = tmp_path / "shifted.txt"
    shifted.write_text("\n".join(["under the big mat a dog sat", "on a rug the cat ran quickly"] * 200))
    held = tmp_path / "held.txt"
    held.write_text("under the small rug a cat ran\non the mat the dog sat slowly\n")
    before = train([shifted], tmp_path / "zero-epochs", "tiny", init=base, epochs=0, heldout=[held])
    tuned = train([shifted], tmp_path / "tuned", "tiny", init=base, epochs=1, heldout=[held])
    ppl_before = before["heldout_perplexity"]["bilm_zero_state"]["forward"]
    assert tuned["heldout_perplexity"]["bilm_zero_state"]["forward"] < ppl_before / 2
    assert tuned["init"] == str(base) and tuned["vocab_size"] == len(Vocabulary.load(base / "vocab.txt"))


def test_fine_tuning_a_published_model_gets_a_new_softmax(corpus, tiny_dir, tmp_path):
    """A folder with only options.json + weights.hdf5 (a published ELMo): its biLM, a vocabulary from the new
    text, a new softmax."""
    published = tmp_path / "published"
    published.mkdir()
    (published / "options.json").write_text((tiny_dir / "options.json").read_text())
    (published / "weights.hdf5").write_bytes((tiny_dir / "lm_weights.hdf5").read_bytes())
    log = train([corpus], tmp_path / "out", "tiny", init=published, epochs=1)
    assert log["options"] == load_options(published / "options.json").to_dict()
    assert log["vocab_size"] == len(WORDS) + 3


def test_configs():
    _, small, cfg = load_config("small")
    assert small.n_layers >= 2 and small.skip_connections and small.proj_dim < small.cell_dim
    assert cfg.vocab_size == 16000
    with pytest.raises(ValueError, match="unknown training settings: bogus"):
        TrainingConfig.from_dict({"bogus": 1})


def test_batches_respect_the_token_budget_and_cover_every_sentence():
    rows = [np.zeros(n, dtype=np.int32) for n in np.random.default_rng(0).integers(3, 40, size=500)]
    batches = make_batches(rows, 256)
    assert sorted(i for b in batches for i in b) == list(range(500))
    for b in batches:
        assert len(b) * max(len(rows[i]) for i in b) <= 256 or len(b) == 1


def test_learning_rate_schedule():
    assert lr_factor(0, 10, 100) == pytest.approx(0.1)
    assert lr_factor(9, 10, 100) == pytest.approx(1.0)
    assert lr_factor(10, 10, 100) == pytest.approx(1.0)
    assert lr_factor(100, 10, 100) == pytest.approx(0.1)


# -- devices, precision, batch size, stopping early (issue 15)


def test_stopping_at_a_step_and_resuming_gives_the_same_weights_as_an_uninterrupted_run(
    corpus, dropout_config, tmp_path
):
    """--stop-after-steps ends the run at a checkpoint mid-epoch; the same call without it resumes: bit for bit
    the weights of one uninterrupted run (on the CPU, in float32)."""
    straight = train([corpus], tmp_path / "straight", dropout_config, epochs=2)
    stopped = train([corpus], tmp_path / "resumed", dropout_config, epochs=2, stop_after_steps=25)  # 21 steps an epoch
    assert stopped == {"finished": False, "out": str(tmp_path / "resumed"), "epoch": 1, "batch": 4, "step": 25}
    assert not (tmp_path / "resumed" / "weights.hdf5").exists()
    resumed = train([corpus], tmp_path / "resumed", dropout_config)
    assert resumed["finished"] and resumed["steps"] == straight["steps"]
    with h5py.File(tmp_path / "straight" / "weights.hdf5") as a, h5py.File(tmp_path / "resumed" / "weights.hdf5") as b:
        for name in ("CNN_proj/W_proj", "RNN_1/RNN/MultiRNNCell/Cell1/LSTMCell/W_0"):
            np.testing.assert_array_equal(a[name][...], b[name][...])


def test_max_minutes_stops_after_the_first_step_past_the_deadline(corpus, tmp_path):
    stopped = train([corpus], tmp_path / "m", "tiny", epochs=1, max_minutes=0)
    assert not stopped["finished"] and stopped["step"] == 1
    assert torch.load(tmp_path / "m" / "checkpoint.pt", weights_only=False)["state"]["step"] == 1


def test_bf16_autocast_trains_resumes_and_exports_float32_published_weights(corpus, dropout_config, tmp_path):
    """bf16 autocast (on the CPU here: torch autocasts matmuls and convolutions to bfloat16 on the CPU too) with
    float32 weights and Adam state: it learns, stops and resumes bit for bit, and writes float32 weights in the
    published layout that load back with the checkpoint's vectors. CUDA itself is not exercised in this test
    (no GPU on the development machine): test_cuda_trains_and_resumes_on_the_gpu does that where there is one."""
    straight = train([corpus], tmp_path / "straight", dropout_config, epochs=2, precision="bf16")
    assert straight["precision"] == "bf16" and straight["device"] == "cpu"
    fp32 = train([corpus], tmp_path / "fp32", dropout_config, epochs=2)
    for direction in ("forward", "backward"):  # it learns about as well as float32 does
        bf16_ppl = straight["heldout_perplexity"]["bilm_zero_state"][direction]
        assert bf16_ppl < 1.15 * fp32["heldout_perplexity"]["bilm_zero_state"][direction]
        assert bf16_ppl < 0.75 * (len(WORDS) + 3)
    train([corpus], tmp_path / "resumed", dropout_config, epochs=2, precision="bf16", stop_after_steps=20)
    checkpoint = torch.load(tmp_path / "resumed" / "checkpoint.pt", weights_only=False)
    assert all(v.dtype == torch.float32 for v in checkpoint["model"].values() if v.is_floating_point())
    moments = [v for s in checkpoint["optimizer"]["state"].values() for k, v in s.items() if k != "step"]
    assert moments and all(v.dtype == torch.float32 for v in moments)
    train([corpus], tmp_path / "resumed", dropout_config, precision="bf16")
    out = tmp_path / "resumed"
    with h5py.File(tmp_path / "straight" / "weights.hdf5") as a, h5py.File(out / "weights.hdf5") as b:
        assert set(a) == set(b)
        for name in ("char_embed", "CNN_proj/W_proj", "RNN_0/RNN/MultiRNNCell/Cell0/LSTMCell/W_0"):
            assert b[name].dtype == np.float32
            np.testing.assert_array_equal(a[name][...], b[name][...])
    bilm = load_bilm(out / "options.json", out / "weights.hdf5")
    model = BiLanguageModel(load_options(out / "options.json"), len(Vocabulary.load(out / "vocab.txt")))
    model.load_state_dict(torch.load(out / "checkpoint.pt", weights_only=False)["model"])
    model.eval()
    sentences = [["the", "cat", "sat"], ["a", "big", "dog", "ran", "slowly"]]
    for a, b in zip(torch_layers(bilm, sentences), torch_layers(model.bilm, sentences), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the lent GPU machine)")
def test_cuda_trains_and_resumes_on_the_gpu(corpus, dropout_config, tmp_path):
    """Runs only where torch sees a GPU (the development machine has none, so this was not run there): a bf16 run
    on CUDA stops and resumes (the CUDA RNG state travels in the checkpoint), its checkpoint loads on the CPU, and
    it writes float32 weights that load back."""
    stopped = train([corpus], tmp_path / "gpu", dropout_config, epochs=2, device="cuda", precision="bf16",
                    batch_tokens=512, stop_after_steps=10)  # fmt: skip
    assert not stopped["finished"]
    log = train([corpus], tmp_path / "gpu", dropout_config, device="cuda", precision="bf16")
    assert log["finished"] and log["device"] == "cuda" and log["config"]["batch_tokens"] == 512
    train([corpus], tmp_path / "default", "tiny", device="cuda", stop_after_steps=1)
    assert torch.load(tmp_path / "default" / "checkpoint.pt", weights_only=False)["config"]["batch_tokens"] == 32768
    checkpoint = torch.load(tmp_path / "gpu" / "checkpoint.pt", weights_only=False, map_location="cpu")
    assert checkpoint["cuda_rng"] is not None
    bilm = load_bilm(tmp_path / "gpu" / "options.json", tmp_path / "gpu" / "weights.hdf5")
    assert all(p.dtype == torch.float32 for p in bilm.parameters())
    for direction in ("forward", "backward"):
        assert log["heldout_perplexity"]["bilm_zero_state"][direction] < (len(WORDS) + 3) / 3


def test_device_auto_is_the_cpu_here_and_cuda_without_a_gpu_is_refused(monkeypatch):
    from training.trainer import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    assert resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match=r"--device cuda: .* sees no CUDA GPU"):
        resolve_device("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device("auto") == torch.device("cuda")


def test_batch_tokens_is_fixed_when_a_run_starts(corpus, tmp_path):
    stopped = train([corpus], tmp_path / "b", "tiny", epochs=1, batch_tokens=256, stop_after_steps=2)
    assert not stopped["finished"]
    with pytest.raises(ValueError, match="made with batches of 256 tokens"):
        train([corpus], tmp_path / "b", "tiny", batch_tokens=1024)
    log = train([corpus], tmp_path / "b", "tiny")  # resumes with its own batches
    assert log["config"]["batch_tokens"] == 256
    assert log["steps"] == len(make_batches([np.zeros(len(line.split()) + 2) for line in _train_lines(corpus)], 256))


def _train_lines(corpus: Path) -> list[str]:
    lines = [line for line in corpus.read_text().splitlines() if line.strip()]
    return [line for i, line in enumerate(lines) if i % 50 != 49]


def test_perplexity_per_held_out_file(corpus, tmp_path):
    """One held-out file per source: the log and the model card give each one's biLM and bigram figures."""
    a, b = write_corpus(tmp_path / "alpha.txt", 30, seed=3), write_corpus(tmp_path / "beta.txt", 20, seed=4)
    log = train([corpus], tmp_path / "out", "tiny", epochs=1, heldout=[a, b])
    by_file = log["heldout_perplexity_by_file"]
    assert set(by_file) == {"alpha", "beta"}
    assert by_file["alpha"]["tokens"] == sum(len(line.split()) for line in a.read_text().splitlines())
    for f in by_file.values():
        assert f["bilm_zero_state"]["forward"] > 1 and f["kneser_ney_bigram"]["backward"] > 1
    card = (tmp_path / "out" / "MODEL_CARD.md").read_text()
    assert "| alpha |" in card and "| beta |" in card
    assert log["sources"] is None  # no corpus manifest beside this text


def test_an_empty_or_ambiguous_held_out_file_is_refused_before_training(corpus, tmp_path):
    a, empty = write_corpus(tmp_path / "alpha.txt", 30, seed=3), tmp_path / "empty.txt"
    empty.write_text("\n")
    with pytest.raises(ValueError, match=r"held-out file with no sentences: .*empty\.txt"):
        train([corpus], tmp_path / "out", "tiny", epochs=1, heldout=[a, empty])
    (tmp_path / "other").mkdir()
    twin = write_corpus(tmp_path / "other" / "alpha.txt", 10, seed=5)
    with pytest.raises(ValueError, match="different names"):
        train([corpus], tmp_path / "out", "tiny", epochs=1, heldout=[a, twin])
    assert not (tmp_path / "out" / "checkpoint.pt").exists()  # nothing trained


def test_a_step_budget_ends_training_inside_an_epoch_with_the_schedule_spanning_it(corpus, tmp_path):
    """`steps` stops a run before its epochs end (21 batches an epoch here): the finished model is written, its
    learning rate has decayed to the schedule's end at the last step, and the card says what share it saw."""
    log = train([corpus], tmp_path / "b", "tiny", epochs=2, steps=15)
    assert log["finished"] and log["steps"] == 15 and log["config"]["steps"] == 15
    assert (tmp_path / "b" / "weights.hdf5").exists()
    assert 0 < log["tokens_seen"] < log["train_tokens"] + log["train_sentences"]
    payload = torch.load(tmp_path / "b" / "checkpoint.pt", weights_only=False)
    assert payload["optimizer"]["param_groups"][0]["lr"] == pytest.approx(0.03 * lr_factor(14, 5, 15))
    assert "a budget of 15 steps (" in (tmp_path / "b" / "MODEL_CARD.md").read_text()
    assert train([corpus], tmp_path / "b", "tiny", epochs=2, steps=15)["steps"] == 15  # finished: no more steps


def test_a_larger_step_budget_continues_the_epoch_where_the_smaller_one_ended(corpus, tmp_path):
    """A run that ended at its step budget inside the epoch (10 of 21 batches) is continued by a rerun with a
    larger budget: it goes on with the epoch's remaining batches, so every batch is seen once and none twice
    (a checkpoint once marked such an epoch as over, and the rerun trained nothing)."""
    first = train([corpus], tmp_path / "b", "tiny", epochs=1, steps=10)
    assert first["finished"] and first["steps"] == 10
    more = train([corpus], tmp_path / "b", "tiny", epochs=1, steps=21)
    straight = train([corpus], tmp_path / "straight", "tiny", epochs=1)
    assert more["steps"] == straight["steps"] == 21
    assert more["tokens_seen"] == straight["tokens_seen"]  # the same batches in all, each once
