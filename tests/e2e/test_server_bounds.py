"""The HTTP server's bounds on bodies answered early and bodies in tiny chunks, against real elmo-serve processes: a
connection answered before its body has all arrived is closed by its keep-alive timer unless the rest comes (it
kept no timer), and a chunked body's chunks must not be tiny. `python -m bench.hostile --rows
early-answers,tiny-chunks` measures the same attacks at full size."""

from __future__ import annotations

import contextlib
import select
import socket
import time

import pytest

from tests.live_server import running_server

KEEP_ALIVE_S, HEAD_TIMEOUT_S = 1, 2


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    settings = {
        "ELMO_API_KEYS": "test-key",
        "ELMO_KEEP_ALIVE_S": str(KEEP_ALIVE_S),
        "ELMO_HEAD_TIMEOUT_S": str(HEAD_TIMEOUT_S),
        "ELMO_MAX_BODY_BYTES": str(1 << 20),
    }
    with running_server(tiny_model_dir, tmp_path_factory.mktemp("bounds"), settings) as s:
        yield s


def read_answer(sock: socket.socket) -> bytes:
    """The head of the answer on `sock` (the bytes up to its blank line)."""
    got = b""
    while b"\r\n\r\n" not in got:
        part = sock.recv(65536)
        assert part, got
        got += part
    return got


def closed_within(sock: socket.socket, seconds: float) -> bool:
    """Whether the server closes `sock` (end of file or a reset) within `seconds`, whatever it still sends."""
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        if not select.select([sock], [], [], left)[0]:
            return False
        try:
            if not sock.recv(65536):
                return True
        except ConnectionResetError:
            return True
    return False


@pytest.mark.parametrize(
    ("head", "status"),
    [
        (
            b"POST /embed HTTP/1.1\r\nhost: [::1]\r\ncontent-type: application/json\r\ncontent-length: 1000\r\n\r\n",
            b"401",
        ),
        (
            b"POST /embed HTTP/1.1\r\nhost: [::1]\r\nauthorization: Bearer test-key\r\n"
            b"content-type: application/json\r\n"
            b"content-length: 5000000\r\n\r\n",
            b"413",
        ),
    ],
    ids=["401", "413"],
)
def test_a_connection_answered_before_its_body_came_is_closed(server, head, status):
    # uvicorn armed its keep-alive timer once the early answer was sent, and the body's next byte cancelled it for
    # good: twenty such connections were all still open 30 s later.
    socks = []
    for _ in range(20):
        sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
        sock.sendall(head + b"{")
        assert read_answer(sock).split(b" ", 2)[1] == status
        sock.sendall(b"x")  # one more byte of the body, after the answer
        socks.append(sock)
    wait = KEEP_ALIVE_S + HEAD_TIMEOUT_S + 3
    still_open = sum(not closed_within(sock, wait) for sock in socks)
    for sock in socks:
        sock.close()
    assert still_open == 0


def test_a_connection_whose_answered_body_comes_whole_carries_the_next_request(server):
    head = b"POST /embed HTTP/1.1\r\nhost: [::1]\r\ncontent-type: application/json\r\ncontent-length: 1000\r\n\r\n"
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(head + b"{")
        assert read_answer(sock).split(b" ", 2)[1] == b"401"
        sock.sendall(b" " * 999 + b"GET /health/live HTTP/1.1\r\nhost: [::1]\r\n\r\n")
        got = b""
        while b"HTTP/1.1 200" not in got:
            part = sock.recv(65536)
            assert part, got
            got += part


def chunked_head(path: str = "/embed") -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nhost: [::1]\r\nauthorization: Bearer test-key\r\ncontent-type: application/json\r\n"
        "transfer-encoding: chunked\r\n\r\n"
    ).encode()


def test_a_body_in_one_byte_chunks_is_refused_early(server):
    body = b'{"sentences": [["a"]], "pad": "' + b"x" * 200_000 + b'"}'
    chunks = b"".join(b"1\r\n%s\r\n" % body[k : k + 1] for k in range(len(body))) + b"0\r\n\r\n"
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(chunked_head())
        start = time.monotonic()
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # refused, closed before all was sent
            sock.sendall(chunks)
        answer = read_answer(sock) + sock.recv(65536)
        seconds = time.monotonic() - start
    assert answer.startswith(b"HTTP/1.1 400 "), answer
    assert b"body: sent in over 1024 chunks averaging 1 bytes" in answer and b"connection: close" in answer
    assert seconds < 2


def test_a_body_in_chunks_of_under_a_kilobyte_past_the_free_ones_is_served(server):
    body = b'{"sentences": [["a", "b"]], "pooling": "mean"}'.ljust(1_024_000, b" ")
    # 1,280 chunks of 800 bytes: past the 1,024 free ones, yet within the average's bound all along
    chunks = b"".join(b"%x\r\n%s\r\n" % (800, body[k : k + 800]) for k in range(0, len(body), 800))
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(chunked_head() + chunks + b"0\r\n\r\n")
        answer = read_answer(sock)
    assert answer.startswith(b"HTTP/1.1 200 "), answer
