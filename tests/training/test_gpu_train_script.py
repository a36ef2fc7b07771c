"""scripts/gpu-train.sh, the GPU training plan: what can be checked without a GPU (its steps themselves run only on
the lent GPU machine; their parts, elmo-train --device cuda, training.sweep and the corpus, are tested in
tests/training/)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu-train.sh"


def test_the_script_parses_and_names_its_steps():
    assert subprocess.run(["bash", "-n", str(SCRIPT)]).returncode == 0
    run = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True)
    assert run.returncode == 2 and "sweep|train|fetch" in run.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_sweep_refuses_to_start_without_a_gpu(tmp_path):
    run = subprocess.run(
        ["bash", str(SCRIPT), "sweep"],
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin", "PY": sys.executable, "OUT": str(tmp_path)},
        timeout=120,
    )
    assert run.returncode != 0 and "torch sees no GPU" in run.stderr
