"""Settings from the environment: ELMO_MODELS (several models) against ELMO_MODEL_DIR (one)."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from service.settings import DEFAULT_MODEL_DIR, Settings, invalid_settings, parse_models, unknown_variables


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
    # by their folders' names: where the server's files lie is no client's business (/info shows this)
    assert settings.public()["models"] == [["en", "elmo-original"], ["tiny", "tiny"], ["pubmed.v2", "p=q"]]
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


def test_a_bad_value_is_one_line_with_the_variable_the_value_and_what_it_takes(monkeypatch):
    monkeypatch.setenv("ELMO_PORT", "abc")
    monkeypatch.setenv("ELMO_HEAD_TIMEOUT_S", "0")
    monkeypatch.setenv("ELMO_MODELS", "en")
    with pytest.raises(ValidationError) as refused:
        Settings()
    assert invalid_settings(refused.value) == [
        "ELMO_MODELS='en': 'en' is not name=folder (ELMO_MODELS=name=folder,name2=folder2)",
        "ELMO_PORT='abc' is not valid: it takes an integer from 0 to 65535",
        "ELMO_HEAD_TIMEOUT_S='0' is not valid: it takes a number above 0",
    ]


def test_conflicting_settings_are_one_line_naming_both(monkeypatch):
    monkeypatch.setenv("ELMO_MODELS", "en=/m/en")
    monkeypatch.setenv("ELMO_MODEL_NAME", "x")
    with pytest.raises(ValidationError) as refused:
        Settings()
    (line,) = invalid_settings(refused.value)
    assert line.startswith("both ELMO_MODELS and ELMO_MODEL_NAME given")


def test_the_log_level_is_one_of_logging_s_in_any_case(monkeypatch):
    monkeypatch.setenv("ELMO_LOG_LEVEL", "DEBUG")
    assert Settings().log_level == "debug"  # uvicorn knows the lower-case names only


def test_unknown_variables_are_named_with_the_closest_setting():
    environ = {"ELMO_BATCH_TOKEN": "5", "ELMO_PORT": "1", "elmo_windw": "3", "ELMO_FOO": "1", "ELMO_URL": "x",
               "ELMO_API_KEY": "k", "HOME": "/root"}  # fmt: skip
    assert unknown_variables(environ) == [
        "ELMO_BATCH_TOKEN is not a setting and is ignored: did you mean ELMO_BATCH_TOKENS?",
        "ELMO_FOO is not a setting and is ignored: the settings are listed in README.md, Configuration",
        "elmo_windw is not a setting and is ignored: did you mean ELMO_WINDOW?",
    ]  # ELMO_URL and ELMO_API_KEY: elmo_client's, set where a client runs


def test_forwarded_headers_are_trusted_only_from_addresses_or_networks_named(monkeypatch):
    assert Settings().forwarded_allow_ips == []  # none by default: uvicorn's own default trusted 127.0.0.1
    monkeypatch.setenv("ELMO_FORWARDED_ALLOW_IPS", " 10.0.0.0/8, 127.0.0.1,::1 ")
    assert Settings().forwarded_allow_ips == ["10.0.0.0/8", "127.0.0.1", "::1"]
    for value, reason in (("*", "'*' would trust any peer's X-Forwarded-For"), ("proxy.local", "neither an IP")):
        monkeypatch.setenv("ELMO_FORWARDED_ALLOW_IPS", value)
        with pytest.raises(ValidationError) as refused:
            Settings()
        (line,) = invalid_settings(refused.value)
        assert line.startswith(f"ELMO_FORWARDED_ALLOW_IPS={value!r}: ") and reason in line, line


def test_an_address_s_answer_budget_holds_a_largest_answer(monkeypatch):
    monkeypatch.setenv("ELMO_MAX_ANSWERS_INFLIGHT_BYTES_PER_CLIENT", str(32 << 20))
    with pytest.raises(ValidationError) as refused:
        Settings()
    (line,) = invalid_settings(refused.value)
    assert line.startswith("ELMO_MAX_ANSWERS_INFLIGHT_BYTES_PER_CLIENT (33554432) is below ELMO_MAX_ANSWER_BYTES")
