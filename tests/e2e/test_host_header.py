"""HTTP/1.1's Host rules and versions against a real elmo-serve on 127.0.0.1 (service/server/hosts.py and the
protocol): no Host or two of them is 400; a loopback-bound server answers loopback names alone, so that a web page
using DNS rebinding cannot call it (`/info` and `/embed` answered 200 to any Host), unless ELMO_ALLOWED_HOSTS names
more; a request line of a version it does not speak is 505 (HTTP/2.0 was served as 1.1)."""

from __future__ import annotations

import json

import pytest

from tests.live_server import raw_exchange, running_server

EMBED = json.dumps({"sentences": [["a", "b"]]}).encode()


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    with running_server(tiny_model_dir, tmp_path_factory.mktemp("hosts")) as s:  # ELMO_HOST: 127.0.0.1
        yield s


@pytest.fixture(scope="module")
def named(tiny_model_dir, tmp_path_factory):
    allowed = {"ELMO_ALLOWED_HOSTS": "elmo.example.com, .corp.example"}
    with running_server(tiny_model_dir, tmp_path_factory.mktemp("hosts-named"), allowed) as s:
        yield s


@pytest.fixture(scope="module")
def any_host(tiny_model_dir, tmp_path_factory):
    with running_server(tiny_model_dir, tmp_path_factory.mktemp("hosts-any"), {"ELMO_ALLOWED_HOSTS": "*"}) as s:
        yield s


def _request(port: int, fields: bytes, path: str = "/info", version: bytes = b"HTTP/1.1", body: bytes = b""):
    method = b"POST" if body else b"GET"
    framing = b"content-type: application/json\r\ncontent-length: %d\r\n" % len(body) if body else b""
    data = method + b" " + path.encode() + b" " + version + b"\r\n" + fields + framing + b"connection: close\r\n\r\n"
    (answer,) = raw_exchange(port, data + body, 1)
    return answer


def _host(port: int, name: bytes, path: str = "/info", body: bytes = b"") -> tuple[int, dict]:
    status, _, answer = _request(port, b"host: " + name + b"\r\n", path, body=body)
    return status, json.loads(answer) if answer else {}


LOOPBACK = [b"127.0.0.1", b"127.0.0.1:%d", b"localhost", b"LOCALHOST:%d", b"[::1]:%d", b"127.0.0.2", b"app.localhost",
            b"localhost."]  # fmt: skip
FOREIGN = [
    b"rebind.attacker.example",
    b"rebind.attacker.example:%d",
    b"192.168.1.20",
    b"x",
    b"",
    b"localhost.evil.example",
]


@pytest.mark.parametrize("name", LOOPBACK, ids=[n.decode() for n in LOOPBACK])
def test_loopback_names_are_answered(server, name):
    name = name % server.port if b"%d" in name else name
    assert _host(server.port, name)[0] == 200
    assert _host(server.port, name, "/embed", EMBED)[0] == 200


@pytest.mark.parametrize("name", FOREIGN, ids=[n.decode() or "empty" for n in FOREIGN])
def test_another_name_is_refused_on_a_loopback_bind(server, name):
    name = name % server.port if b"%d" in name else name
    for path, body in (("/info", b""), ("/embed", EMBED), ("/health/ready", b"")):
        status, answer = _host(server.port, name, path, body)
        assert status == 400, answer  # was 200: a page using DNS rebinding could call it
        assert answer["detail"].startswith("host: ") and "is not a name of this server" in answer["detail"]


def test_a_request_without_host_or_with_two_is_refused(server):
    status, _, answer = _request(server.port, b"")
    assert status == 400 and json.loads(answer)["detail"] == "host: missing: an HTTP/1.1 request names its Host"
    status, _, answer = _request(server.port, b"host: 127.0.0.1\r\nhost: evil.example\r\n")
    assert status == 400 and json.loads(answer)["detail"] == "host: 2 Host headers; send one"
    status, _, answer = _request(server.port, b"host: 127.0.0.1\r\nhost: 127.0.0.1\r\n")
    assert status == 400  # even the same twice: a proxy may read one, this server the other
    status, _, answer = _request(server.port, b"host: local host\r\n")
    assert status == 400 and "is not a host name" in json.loads(answer)["detail"]


def test_http_1_0_may_leave_host_out(server):
    status, _, _ = _request(server.port, b"", version=b"HTTP/1.0")
    assert status == 200


@pytest.mark.parametrize("version", [b"HTTP/2.0", b"HTTP/0.9"])
def test_a_version_it_does_not_speak_is_505(server, version):
    status, headers, answer = _request(server.port, b"host: 127.0.0.1\r\n", version=version)
    assert status == 505, answer  # HTTP/2.0 was served as 1.1
    assert json.loads(answer)["detail"] == f"request: {version.decode()} is not spoken here: send HTTP/1.1"
    assert headers["connection"] == "close"


def test_allowed_hosts_adds_names_and_subdomains(named):
    for name in (b"elmo.example.com", b"ELMO.example.com:443", b"corp.example", b"a.b.corp.example", b"localhost"):
        assert _host(named.port, name)[0] == 200, name
    for name in (b"example.com", b"evilcorp.example", b"elmo.example.com.evil"):
        assert _host(named.port, name)[0] == 400, name


def test_allowed_hosts_star_answers_any_name_but_still_one(any_host):
    assert _host(any_host.port, b"rebind.attacker.example")[0] == 200
    assert _request(any_host.port, b"host: a\r\nhost: b\r\n")[0] == 400


def test_nothing_refused_here_left_a_traceback(server):
    assert "Traceback" not in server.log.read_text()
