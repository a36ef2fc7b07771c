"""Settings from the environment: ELMO_MODELS (several models) against ELMO_MODEL_DIR (one)."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from service.settings import DEFAULT_MODEL_DIR, Settings, parse_models


@pytest.fixture(autouse=True)
def no_elmo_environment(monkeypatch):
    """Only what a test sets: an ELMO_* variable of the shell would change what is read."""
    import os

    for name in [n for n in os.environ if n.startswith("ELMO_")]:
        monkeypatch.delenv(name)


def test_unset_one_model_named_by_its_folder_as_before():
    assert Settings().models == [("default", DEFAULT_MODEL_DIR)]
    assert Settings(model_dir=Path("/m/elmo-original")).models == [("elmo-original", Path("/m/elmo-original"))]
    assert Settings(model_dir="/m/x", model_name="shown name").models == [("shown name", Path("/m/x"))]


def test_elmo_models_in_order_from_the_environment(monkeypatch):
    monkeypatch.setenv("ELMO_MODELS", " en=/models/elmo-original , tiny=build/models/tiny,pubmed.v2=/m/p=q ,")
    settings = Settings()
    assert settings.models == [
        ("en", Path("/models/elmo-original")),
        ("tiny", Path("build/models/tiny")),
        ("pubmed.v2", Path("/m/p=q")),  # split at the first '=': a folder may hold one
    ]
    assert settings.public()["models"] == [["en", "/models/elmo-original"], ["tiny", "build/models/tiny"],
                                           ["pubmed.v2", "/m/p=q"]]  # fmt: skip
    assert settings.model_dir == DEFAULT_MODEL_DIR and settings.model_name is None


def test_an_empty_elmo_models_is_unset(monkeypatch):
    monkeypatch.setenv("ELMO_MODELS", "")
    assert Settings().models == [("default", DEFAULT_MODEL_DIR)]


def test_a_flag_value_is_parsed_like_the_environment():
    assert Settings(models="a=/x,b=/y").models == [("a", Path("/x")), ("b", Path("/y"))]
    assert parse_models("a=/x,,b=/y") == [("a", Path("/x")), ("b", Path("/y"))]


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("a=/x,a=/y", "model names must be unique: a given more than once"),
        ("a=/x,b=/y,b=/z,a=/w", "model names must be unique: a, b given more than once"),
        ("a/x", "'a/x' is not name=folder"),
        ("=/x", "'=/x' is not name=folder"),
        ("a=", "'a=' is not name=folder"),
        ("-a=/x", "model name '-a': letters, digits"),
        (".hidden=/x", "model name '.hidden'"),
        ("a b=/x", "model name 'a b'"),
        ("ünï=/x", "model name 'ünï'"),
        ("a/b=/x", "model name 'a/b'"),
        (f"{'n' * 65}=/x", "at most 64 characters"),
    ],
)
def test_invalid_models_are_refused_with_a_clear_message(monkeypatch, value, message):
    monkeypatch.setenv("ELMO_MODELS", value)
    with pytest.raises(ValidationError) as refused:
        Settings()
    assert message in str(refused.value)
    assert "models" in str(refused.value)


def test_names_of_64_characters_with_dots_dashes_and_underscores_are_fine():
    name = "A0._-" + "x" * 59
    assert Settings(models=f"{name}=/x").models == [(name, Path("/x"))]


def test_elmo_models_with_a_model_dir_is_an_error_naming_both(monkeypatch):
    monkeypatch.setenv("ELMO_MODELS", "a=/x")
    monkeypatch.setenv("ELMO_MODEL_DIR", "/elsewhere")
    with pytest.raises(ValidationError) as refused:
        Settings()
    assert "both ELMO_MODELS and ELMO_MODEL_DIR" in str(refused.value) and "/elsewhere" in str(refused.value)
    with pytest.raises(ValidationError, match="both ELMO_MODELS and ELMO_MODEL_DIR"):
        Settings(models="a=/x", model_dir="/elsewhere")  # --models with --model


def test_elmo_models_with_a_model_name_is_an_error_naming_both(monkeypatch):
    monkeypatch.setenv("ELMO_MODELS", "a=/x")
    monkeypatch.setenv("ELMO_MODEL_NAME", "b")
    with pytest.raises(ValidationError, match="both ELMO_MODELS and ELMO_MODEL_NAME"):
        Settings()


def test_elmo_models_with_the_default_model_dir_is_fine(monkeypatch):
    monkeypatch.setenv("ELMO_MODELS", "a=/x")
    monkeypatch.setenv("ELMO_MODEL_DIR", str(DEFAULT_MODEL_DIR))  # as images and compose files may set it
    assert Settings().models == [("a", Path("/x"))]


def test_an_empty_model_dir_is_unset_so_an_image_can_serve_elmo_models(monkeypatch):
    monkeypatch.setenv("ELMO_MODEL_DIR", "")  # `docker run -e ELMO_MODEL_DIR=` over the image's ENV
    assert Settings().models == [("default", DEFAULT_MODEL_DIR)]
    monkeypatch.setenv("ELMO_MODELS", "a=/models/a,b=/models/b")
    assert Settings().models == [("a", Path("/models/a")), ("b", Path("/models/b"))]
