"""Settings that would open or break the server (every address a trusted proxy, API keys that hold no key, the
metrics port on the main port) are refused before the model loads, with one line naming the variable, on a real
elmo-serve."""

from __future__ import annotations

import time

import pytest

from tests.live_server import free_port, launch, stop

REFUSED = {
    "forwarded-every-ipv4": ({"ELMO_FORWARDED_ALLOW_IPS": "10.0.0.1,0.0.0.0/0"}, "ELMO_FORWARDED_ALLOW_IPS="),
    "forwarded-every-ipv6": ({"ELMO_FORWARDED_ALLOW_IPS": "::/0"}, "ELMO_FORWARDED_ALLOW_IPS="),
    "keys-only-commas": ({"ELMO_API_KEYS": ",,,"}, "ELMO_API_KEYS=',,,': holds no key"),
    "keys-only-spaces": ({"ELMO_API_KEYS": " , "}, "ELMO_API_KEYS=' , ': holds no key"),
    "metrics-port-is-the-port": ({"ELMO_METRICS_PORT": "{port}"}, "ELMO_METRICS_PORT ({port}) is ELMO_PORT"),
}


@pytest.mark.parametrize("case", REFUSED, ids=list(REFUSED))
def test_a_setting_that_would_open_or_break_the_server_is_refused_before_loading(tiny_model_dir, tmp_path, case):
    settings, line = REFUSED[case]
    port = free_port()
    settings = {name: value.format(port=port) for name, value in settings.items()}
    log = tmp_path / "server.log"
    start = time.perf_counter()
    proc = launch(tiny_model_dir, log, settings, port)
    try:
        assert proc.wait(timeout=60) == 1, log.read_text()
    finally:
        stop(proc)  # one that started (before the fix) is stopped
    text = log.read_text()
    assert len(text.splitlines()) == 1 and text.startswith(f"elmo-serve: {line.format(port=port)}"), text
    assert "serving" not in text and time.perf_counter() - start < 30  # the model never loaded
