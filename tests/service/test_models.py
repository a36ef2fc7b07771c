"""load_models (service/models.py): the window each model is served with, from ELMO_WINDOW or the CPU's flags, on a
real tiny model (no server)."""

from __future__ import annotations

import logging

import pytest

from service import models
from service.metrics import Metrics
from service.settings import Settings, default_window

AMX = frozenset({"avx2", "fma", "avx512f", "avx512_vnni", "amx_tile", "amx_int8", "amx_bf16"})  # Sapphire Rapids
VNNI = frozenset({"avx2", "fma", "avx512f", "avx512_vnni"})


def test_the_window_defaults_to_the_hosts():
    assert Settings().window is None  # unset: decided from the CPU's flags at start-up
    assert default_window(AMX) == 16
    assert default_window(VNNI) == 8  # VNNI, no AMX
    assert default_window(frozenset({"avx2", "fma"})) == default_window(frozenset()) == 8
    assert Settings(window=4).public(window=16)["window"] == 4  # set: kept


@pytest.mark.parametrize(("flags", "window", "said"), [(AMX, 16, "this CPU has AMX"), (VNNI, 8, "no AMX")])
def test_an_unset_window_is_the_hosts(tiny_model_dir, monkeypatch, caplog, flags, window, said):
    monkeypatch.setattr(models, "cpu_flags", lambda: flags)  # the host this one is not, as its flags read
    with caplog.at_level(logging.INFO, logger="elmo.service"):
        (served,) = models.load_models(Settings(model_dir=tiny_model_dir, intra_op_threads=1), Metrics())
    assert served.window == window
    assert f"a window of {window} positions a call ({said})" in caplog.text


def test_a_set_window_wins_and_is_not_announced(tiny_model_dir, monkeypatch, caplog):
    monkeypatch.setattr(models, "cpu_flags", lambda: AMX)
    with caplog.at_level(logging.INFO, logger="elmo.service"):
        (served,) = models.load_models(Settings(model_dir=tiny_model_dir, intra_op_threads=1, window=4), Metrics())
    assert served.window == 4
    assert "positions a call" not in caplog.text
