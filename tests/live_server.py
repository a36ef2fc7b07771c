"""A real elmo-serve process for end-to-end tests: uvicorn on 127.0.0.1 with a free port, spoken to over real
sockets. The working tree's code is served (the process starts in the repository root)."""

from __future__ import annotations

import http.client
import os
import resource
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parents[1]
SERVE = "import sys; from service.cli import serve_main; sys.exit(serve_main())"
STARTUP_S = 60
STOP_S = 20
# What every test server uses unless a test says otherwise: CPU, one thread each (the machine is shared).
BASE_SETTINGS = {"ELMO_PROVIDER": "cpu", "ELMO_INTRA_OP_THREADS": "1", "ELMO_INTER_OP_THREADS": "1"}


@dataclass(frozen=True)
class Server:
    url: str
    port: int
    log: Path
    proc: subprocess.Popen

    @property
    def pid(self) -> int:
        return self.proc.pid


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(
    model_dir: Path | str | None,
    log: Path,
    settings: dict[str, str],
    port: int,
    open_files: tuple[int, int] | None = None,
) -> subprocess.Popen:
    """Start elmo-serve with exactly these ELMO_* settings (on top of BASE_SETTINGS); its output goes to `log`.
    `model_dir` None: no --model (the settings name the models: ELMO_MODELS). `open_files`: its open-files limit,
    (soft, hard), as a host with that limit would start it."""
    # Only our ELMO_* settings: one left in the environment (a batch size, a limit) would change what is tested.
    env = {k: v for k, v in os.environ.items() if not k.startswith("ELMO_")}
    env |= BASE_SETTINGS | settings
    model = [] if model_dir is None else ["--model", str(model_dir)]
    cmd = [sys.executable, "-c", SERVE, *model, "--port", str(port)]
    limit = None if open_files is None else partial(resource.setrlimit, resource.RLIMIT_NOFILE, open_files)
    with log.open("wb") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO, preexec_fn=limit)


def refused_to_start(model_dir: Path | str, log: Path, settings: dict[str, str], seconds: float = 60) -> str:
    """Start a real elmo-serve that must exit non-zero without ever listening; its output."""
    proc = launch(model_dir, log, settings, free_port())
    try:
        returncode = proc.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        pytest.fail(f"still running {seconds} s after start:\n{log.read_text()}")
    text = log.read_text()
    assert returncode != 0, text
    assert "Application startup complete" not in text and "Uvicorn running" not in text, text
    return text


def wait_ready(proc: subprocess.Popen, url: str, log: Path) -> None:
    deadline = time.monotonic() + STARTUP_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"elmo-serve exited with {proc.returncode} before it was ready:\n{log.read_text()}")
        try:
            if httpx.get(f"{url}/health/ready", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    pytest.fail(f"elmo-serve not ready within {STARTUP_S} s:\n{log.read_text()}")


def stop(proc: subprocess.Popen) -> int:
    """SIGTERM, then SIGKILL if it does not exit within STOP_S; its exit status."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=STOP_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


@contextmanager
def running_server(
    model_dir: Path | str | None,
    folder: Path,
    settings: dict[str, str] | None = None,
    open_files: tuple[int, int] | None = None,
) -> Iterator[Server]:
    """A ready server for the duration of the block; stopped (and its log kept in `folder`) afterwards."""
    port, log = free_port(), folder / "server.log"
    proc = launch(model_dir, log, settings or {}, port, open_files)
    try:
        wait_ready(proc, f"http://127.0.0.1:{port}", log)
        yield Server(f"http://127.0.0.1:{port}", port, log, proc)
    finally:
        stop(proc)


# Under /v1/ the service answers as OpenAI does: 400 where its own routes answer 413 or 422 (service/api/errors.py).
OPENAI_STATUS = {413: 400, 422: 400}


def status_on(path: str, status: int) -> int:
    """The status a route answers for what /embed answers `status` to: OpenAI's under /v1/."""
    return OPENAI_STATUS.get(status, status) if path.startswith("/v1/") else status


def refusal(response: httpx.Response) -> str:
    """An error answer's message: `detail` on the service's own routes; under /v1/, `error.message`, the body
    checked to be OpenAI's error shape. Either way the body names its request id, the one its header gives."""
    body = response.json()
    assert body.pop("request_id") == response.headers["x-request-id"], body
    if response.request.url.path.startswith("/v1/"):
        assert list(body) == ["error"] and list(body["error"]) == ["message", "type", "param", "code"], body
        return body["error"]["message"]
    return body["detail"]


def counter(client: httpx.Client, name: str, **labels) -> float:
    """One sample of the server's /metrics (0 if absent)."""
    for family in text_string_to_metric_families(client.get("/metrics").text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return 0.0


def answered_statuses(client: httpx.Client) -> set[str]:
    """Every status the server has answered so far, from elmo_requests_total."""
    return {
        sample.labels["status"]
        for family in text_string_to_metric_families(client.get("/metrics").text)
        for sample in family.samples
        if sample.name == "elmo_requests_total"
    }


def rss_bytes(pid: int, field: str = "VmRSS") -> int:
    """Resident memory of a process (VmRSS in /proc; VmHWM: the most it ever had)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} for process {pid}")


def peak_rss_bytes(pid: int) -> int:
    return rss_bytes(pid, "VmHWM")


class SlowBody:
    """A request on a raw socket whose body comes in two parts: it is in flight until `finish()`."""

    def __init__(self, port: int, method: str, path: str, body: bytes, first: float = 0.5):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=60)
        head = (
            f"{method} {path} HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\n\r\n"
        )
        cut = int(len(body) * first)
        self.sock.sendall(head.encode() + body[:cut])
        self.rest = body[cut:]

    def finish(self) -> tuple[int, dict, bytes]:
        self.sock.sendall(self.rest)
        response = http.client.HTTPResponse(self.sock)
        response.begin()
        body = response.read()
        self.sock.close()
        return response.status, dict(response.getheaders()), body


def raw_exchange(port: int, data: bytes, answers: int, timeout: float = 30) -> list[tuple[int, dict, bytes]]:
    """Send `data` on a new connection as it is (pipelined requests, garbage, oversized heads) and read up to
    `answers` responses in order (fewer if the server closes the connection first)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(data)
        stream = sock.makefile("rb")
        got = []
        for _ in range(answers):
            status_line = stream.readline()
            if not status_line:
                break
            headers = {}
            while (line := stream.readline()) not in (b"\r\n", b""):
                name, _, value = line.decode("latin-1").partition(":")
                headers[name.strip().lower()] = value.strip()
            got.append((int(status_line.split()[1]), headers, stream.read(int(headers.get("content-length", 0)))))
        return got
