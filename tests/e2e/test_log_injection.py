"""What a client sends never reaches the text log raw: a path with CR, LF, ESC and NEL, on a real elmo-serve with
the access log on, is logged as `other` (the route unmatched) and leaves no control character in the log."""

from __future__ import annotations

import time

from tests.live_server import raw_exchange, running_server

FORGED = b"/x%0D%0A2026-11-28 12:00:00,000 INFO elmo.access: GET /embed status=200%1B[2K%1B[1A%C2%85"


def test_an_unmatched_path_never_reaches_the_text_log_raw(tiny_model_dir, tmp_path):
    settings = {"ELMO_ACCESS_LOG": "true", "ELMO_LOG_FORMAT": "text"}
    with running_server(tiny_model_dir, tmp_path, settings) as server:
        head = b"GET " + FORGED.replace(b" ", b"%20") + b" HTTP/1.1\r\nhost: [::1]\r\nx-request-id: forged-1\r\n\r\n"
        ((status, _, _),) = raw_exchange(server.port, head, 1)
        assert status == 404
        post = b"POST /embed%0D%0Ax HTTP/1.1\r\nhost: [::1]\r\ncontent-length: 2\r\nx-request-id: forged-2\r\n\r\n{}"
        ((status, _, _),) = raw_exchange(server.port, post, 1)
        assert status in (404, 405)
        time.sleep(0.5)
        log = server.log.read_bytes()
    lines = [line for line in log.split(b"\n") if b"forged-" in line]
    assert len(lines) == 2, log[-2000:]
    assert lines[0].endswith(b"elmo.access: GET other status=404 " + lines[0].split(b"status=404 ")[1])
    assert b"route=" not in lines[0] and b"2026-11-28 12:00:00" not in log  # the path is not logged at all
    for raw in (b"\r", b"\x1b", b"\x85", "\u2028".encode()):
        assert raw not in log, raw
