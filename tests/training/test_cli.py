"""elmo-train's command line (training.cli): a run, and the refusals it prints without a traceback."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch


def test_cli_trains_and_rejects_a_bad_config(corpus, tmp_path):
    script = "import sys; from training.cli import train_main; sys.exit(train_main())"
    ok = subprocess.run(
        [sys.executable, "-c", script, "--corpus", str(corpus), "--out", str(tmp_path / "m"), "--config", "tiny",
         "--epochs", "1"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert ok.returncode == 0, ok.stderr
    assert "held-out perplexity forward" in ok.stdout
    bad = subprocess.run(
        [sys.executable, "-c", script, "--corpus", str(corpus), "--out", str(tmp_path / "n"), "--config", "huge"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert bad.returncode == 1 and "--config huge" in bad.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without a GPU")
def test_cli_device_cuda_without_a_gpu_fails_with_a_message(corpus, tmp_path):
    script = "import sys; from training.cli import train_main; sys.exit(train_main())"
    run = subprocess.run(
        [sys.executable, "-c", script, "--corpus", str(corpus), "--out", str(tmp_path / "c"), "--config", "tiny",
         "--device", "cuda"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 1
    assert "elmo-train: --device cuda:" in run.stderr and "no CUDA GPU" in run.stderr
    assert "Traceback" not in run.stderr and not (tmp_path / "c").exists()
