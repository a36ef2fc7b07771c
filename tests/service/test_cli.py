"""elmo-serve's checks before it loads a model (elmo-embed's are in test_bulk.py)."""

import socket
from pathlib import Path

import h5py
import pytest
import tomllib

from service import __version__
from service.cli import cannot_listen, embed_main, serve_main


def test_a_port_in_use_is_named_before_the_model_loads(tiny_model_dir, capsys, monkeypatch):
    monkeypatch.delenv("ELMO_HOST", raising=False)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert cannot_listen("127.0.0.1", port) is not None
        assert serve_main(["--model", str(tiny_model_dir), "--port", str(port)]) == 1
    err = capsys.readouterr().err
    assert f"cannot listen on 127.0.0.1:{port}" in err and "ELMO_PORT" in err
    assert cannot_listen("127.0.0.1", port) is None  # free again
    assert cannot_listen("127.0.0.1", 0) is None  # any free port


def test_an_address_not_on_this_machine_is_named(tiny_model_dir, capsys):
    # 192.0.2.1 is a documentation address (TEST-NET-1): never this machine's, and no DNS is asked
    assert serve_main(["--model", str(tiny_model_dir), "--host", "192.0.2.1", "--port", "8000"]) == 1
    assert "cannot listen on 192.0.2.1:8000 (Cannot assign requested address)" in capsys.readouterr().err


def test_models_are_checked_one_by_one_before_any_loads(tiny_model_dir, tmp_path, capsys, monkeypatch):
    for name in ("ELMO_MODELS", "ELMO_MODEL_DIR", "ELMO_MODEL_NAME"):
        monkeypatch.delenv(name, raising=False)
    missing = tmp_path / "missing"
    assert serve_main(["--models", f"tiny={tiny_model_dir},other={missing}", "--port", "0"]) == 1
    assert f"elmo-serve: model 'other': {missing / 'manifest.json'} not found" in capsys.readouterr().err
    assert serve_main(["--models", f"a={tiny_model_dir},a={tiny_model_dir}", "--port", "0"]) == 1
    assert "model names must be unique: a given more than once" in capsys.readouterr().err
    assert serve_main(["--models", f"a={tiny_model_dir}", "--model", str(tiny_model_dir), "--port", "0"]) == 1
    assert "both ELMO_MODELS and ELMO_MODEL_DIR (or --model" in capsys.readouterr().err


def test_version_is_single_sourced_and_reported(capsys):
    pyproject = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    assert "version" not in pyproject["project"] and pyproject["project"]["dynamic"] == ["version"]
    assert pyproject["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "service.__version__"}
    for main, name in ((serve_main, "elmo-serve"), (embed_main, "elmo-embed")):
        with pytest.raises(SystemExit) as stop:
            main(["--version"])
        assert stop.value.code == 0 and capsys.readouterr().out == f"{name} {__version__}\n"


def test_elmo_embed_without_a_model_embeds_with_the_embedded_default(tmp_path, capsys):
    (tmp_path / "in.txt").write_text("The bank of the river .\nHello\n")  # 6 tokens, 1
    assert embed_main([str(tmp_path / "in.txt"), str(tmp_path / "out.hdf5"), "--no-progress", "--threads", "1"]) == 0
    with h5py.File(tmp_path / "out.hdf5", "r") as out:
        assert out["0"].shape == (3, 6, 256) and out["1"].shape == (3, 1, 256)
