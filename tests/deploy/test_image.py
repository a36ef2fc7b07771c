"""`docker compose up` under test (`make image-test`; CI runs it after the rest of the suite): the CPU image built
from docker/Dockerfile and started by docker-compose.yml as a user starts it, its health check waited for, its
/embed answer compared with elmo-embed's on the same model (max abs error <= 1e-5), and stopped with SIGTERM, which
it must survive into a clean exit (status 0).

The engine: Docker with compose where a Docker engine answers; else podman with podman-compose (from PyPI, a dev
dependency: Debian's 1.0.3 ignores `profiles`), which as root on a fresh machine this installs from Debian with runc
(podman's crun default fails on the project's machines, as do its default ulimits). Where no container registry
can be reached, the base image is made here (docker/base-image.sh: debootstrap of Debian bookworm), and where the
PyTorch index cannot be, torch comes from a local index of the wheels pip finds here (docker/torch-index.sh),
served on 127.0.0.1 to a build on the host's network: the offline way to build that README.md describes.

What it leaves: the images (a later run reuses their layers). What it removes: its containers and network, and
on podman run as root the netfilter tables and forwarding its network added, which would otherwise keep sending
the machine's loopback traffic through connection tracking (other tests' servers are on 127.0.0.1)."""

from __future__ import annotations

import functools
import http.server
import json
import os
import shutil
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import h5py
import httpx
import numpy as np
import pytest
import yaml

from tests.live_server import free_port

pytestmark = pytest.mark.image

ROOT = Path(__file__).resolve().parents[2]
WORK = ROOT / "build" / "image-test"  # logs, the engine's settings, the local torch index
PROJECT = "elmo-image-test"  # the compose project: its containers and network are named after it
IMAGE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]["elmo"]["image"]  # its `elmo` service's
LOCAL_BASE = "elmo-python:bookworm"  # docker/base-image.sh's
READY_S = 240  # the health check's start period is 60 s; the model loads in seconds
SENTENCES = [["The", "bank", "of", "the", "river", "."], ["She", "went", "to", "the", "bank", "."], ["Hello"]]
# podman on the project's machines: runc, and ulimits within the machine's own (nofile 20000, nproc 32768)
PODMAN_CONF = """[containers]
default_ulimits = ["nofile=20000:20000", "nproc=32768:32768"]
[engine]
runtime = "runc"
"""


@dataclass
class Engine:
    name: str  # docker or podman
    compose: list[str]
    env: dict[str, str] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)  # what each step took, printed at the end

    def run(self, *args: str, log: Path | None = None, timeout: float = 600, check: bool = True, **env: str):
        """The engine (or compose, when args start with "compose") with its settings; output to `log` if given."""
        command = [*self.compose, *args[1:]] if args[0] == "compose" else [self.name, *args]
        out = log.open("ab") if log else subprocess.PIPE
        try:
            done = subprocess.run(
                command,
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**clean_environment(), **self.env, **env},
                cwd=ROOT,
                timeout=timeout,
                check=False,
            )
        finally:
            if log:
                out.close()
        if check and done.returncode != 0:
            shown = log.read_text()[-3000:] if log else done.stdout.decode(errors="replace")
            pytest.fail(f"{' '.join(command)}: exit status {done.returncode}\n{shown}")
        return done


def clean_environment() -> dict[str, str]:
    # No ELMO_* of the shell: compose would pass them to the service, and change what is tested.
    return {k: v for k, v in os.environ.items() if not k.startswith("ELMO_")}


def quiet(*command: str, timeout: float = 60) -> bool:
    try:
        return subprocess.run(command, capture_output=True, timeout=timeout, check=False).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def container_engine() -> Engine:
    if shutil.which("docker") and quiet("docker", "info") and quiet("docker", "compose", "version"):
        return Engine("docker", ["docker", "compose"])
    if not shutil.which("podman"):
        if os.geteuid() != 0 or not shutil.which("apt-get"):
            pytest.fail("no container engine: install Docker with compose, or podman (Debian: podman runc)")
        apt = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        for command in (["apt-get", "update", "-q"], ["apt-get", "install", "-y", "-q", "--no-install-recommends",
                                                      "podman", "runc", "debootstrap"]):  # fmt: skip
            done = subprocess.run(command, capture_output=True, text=True, env=apt, timeout=600, check=False)
            assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    compose = Path(sys.executable).with_name("podman-compose")
    assert compose.exists(), "podman-compose is missing: `make install` installs it (the dev extra)"
    WORK.mkdir(parents=True, exist_ok=True)
    (WORK / "containers.conf").write_text(PODMAN_CONF)
    return Engine("podman", [str(compose)], {"CONTAINERS_CONF": str(WORK / "containers.conf")})


def has_image(engine: Engine, name: str) -> bool:
    return engine.run("image", "inspect", name, check=False).returncode == 0


def reachable(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=15):
            return True
    except OSError:
        return False


@contextmanager
def served_folder(folder: Path) -> Iterator[str]:
    """`folder` over HTTP on 127.0.0.1 (a package index), for as long as the block runs; its URL."""
    handler = functools.partial(QuietHandler, directory=str(folder))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass


@contextmanager
def build_arguments(engine: Engine) -> Iterator[list[str]]:
    """What the build needs here beyond the Dockerfile's defaults: RUNTIME given (buildah does not apply a global
    ARG's default in FROM), a base image made here where no registry answers, and a local torch index where
    PyTorch's cannot be reached (then the build runs on the host's network, to reach it on 127.0.0.1)."""
    args = ["--build-arg", "RUNTIME=cpu"] + (["--format", "docker"] if engine.name == "podman" else [])  # HEALTHCHECK
    started = time.monotonic()
    python = "3.12"
    if not has_image(engine, "python:3.12-slim") and not quiet(
        engine.name, "pull", "docker.io/library/python:3.12-slim", timeout=300
    ):
        if not has_image(engine, LOCAL_BASE):
            done = subprocess.run(
                ["bash", str(ROOT / "docker" / "base-image.sh"), engine.name],
                cwd=ROOT,
                env={**os.environ, **engine.env},
                capture_output=True,
                text=True,
                check=False,
            )
            assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
        args += ["--build-arg", f"PYTHON_IMAGE={LOCAL_BASE}"]
        python = "3.11"  # Debian bookworm's
    engine.seconds["base image"] = time.monotonic() - started
    if reachable("https://download.pytorch.org/whl/cpu/torch/"):
        yield args
        return
    index = WORK / f"torch-index-{python}"
    if not (index / "torch").is_dir():
        done = subprocess.run(["bash", str(ROOT / "docker" / "torch-index.sh"), str(index), python], cwd=ROOT,
                              env={**os.environ, "PYTHON": sys.executable}, capture_output=True, text=True,
                              check=False)  # fmt: skip
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    with served_folder(index) as url:
        yield [*args, "--network", "host", "--build-arg", f"TORCH_INDEX_URL={url}"]


@contextmanager
def netfilter_restored(engine: Engine) -> Iterator[None]:
    """podman as root: the netfilter tables and the forwarding its bridge network adds are removed again when the
    test is over, if they were not there before (Docker keeps its own and is left alone)."""
    if engine.name != "podman" or os.geteuid() != 0 or not shutil.which("nft"):
        yield
        return
    forward = Path("/proc/sys/net/ipv4/ip_forward")

    def tables() -> set[str]:
        listed = subprocess.run(["nft", "list", "tables"], capture_output=True, text=True, check=False).stdout
        return {line.removeprefix("table ").strip() for line in listed.splitlines() if line.startswith("table ")}

    before, forwarding = tables(), forward.read_text()
    try:
        yield
    finally:
        for table in sorted(tables() - before):
            subprocess.run(["nft", "delete", "table", *table.split()], capture_output=True, check=False)
        forward.write_text(forwarding)


def container_id(engine: Engine) -> str:
    listed = engine.run("ps", "-a", "--filter", f"label=com.docker.compose.project={PROJECT}", "--format", "{{.ID}}")
    (ident,) = listed.stdout.decode().split()
    return ident


def wait_healthy(engine: Engine, ident: str) -> None:
    """Until the image's health check passes (podman without systemd runs it on request only)."""
    deadline = time.monotonic() + READY_S
    while time.monotonic() < deadline:
        state = json.loads(engine.run("inspect", ident).stdout)[0]["State"]
        assert state["Running"], f"the container stopped: {engine.run('logs', ident).stdout.decode()[-3000:]}"
        if engine.name == "podman":
            if engine.run("healthcheck", "run", ident, check=False).returncode == 0:
                return
        elif (state.get("Health") or {}).get("Status") == "healthy":
            return
        time.sleep(2)
    pytest.fail(f"not healthy within {READY_S} s: {engine.run('logs', ident).stdout.decode()[-3000:]}")


def elmo_embed(model_dir: Path, folder: Path) -> list[np.ndarray]:
    """elmo-embed's layers for SENTENCES, from the host's export of the same model."""
    text = folder / "sentences.txt"
    text.write_text("".join(" ".join(s) + "\n" for s in SENTENCES))
    out = folder / "vectors.hdf5"
    embed = Path(sys.executable).with_name("elmo-embed")
    done = subprocess.run([str(embed), "--model", str(model_dir), "--provider", "cpu", "--no-progress", str(text),
                           str(out)], capture_output=True, text=True, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr
    with h5py.File(out, "r") as vectors:
        return [vectors[str(i)][()] for i in range(len(SENTENCES))]


def test_docker_compose_up_serves_elmo_embed_s_numbers_and_stops_cleanly(default_model_dir, tmp_path):
    WORK.mkdir(parents=True, exist_ok=True)
    log = WORK / "engine.log"
    log.write_text("")
    engine = container_engine()
    port = free_port()
    with netfilter_restored(engine):
        started = time.monotonic()
        with build_arguments(engine) as args:
            engine.run("build", *args, "-f", "docker/Dockerfile", "-t", IMAGE, ".", log=log, timeout=1800)
        engine.seconds["build"] = time.monotonic() - started - engine.seconds["base image"]
        try:
            started = time.monotonic()
            engine.run("compose", "-p", PROJECT, "up", "-d", "elmo", log=log, ELMO_PORT=str(port))
            ident = container_id(engine)
            wait_healthy(engine, ident)
            engine.seconds["up to healthy"] = time.monotonic() - started

            published = engine.run("port", ident).stdout.decode()
            assert f"127.0.0.1:{port}" in published and "0.0.0.0" not in published  # loopback unless told
            url = f"http://127.0.0.1:{port}"
            info = httpx.get(f"{url}/info", timeout=30).json()
            host = json.loads((default_model_dir / "manifest.json").read_text())
            assert info["model"] == "default" and info["manifest"]["sources"] == host["sources"]  # the same weights
            assert info["kernels"] is True  # this project's kernels, compiled while the image was built
            answer = httpx.post(f"{url}/embed", json={"sentences": SENTENCES, "output": "layers"}, timeout=60)
            assert answer.status_code == 200, answer.text
            served = [np.asarray(item["embedding"], dtype=np.float32) for item in answer.json()["data"]]
            want = elmo_embed(default_model_dir, tmp_path)
            error = max(float(np.abs(s - w).max()) for s, w in zip(served, want, strict=True))
            assert all(s.shape == w.shape for s, w in zip(served, want, strict=True)) and error <= 1e-5, error

            started = time.monotonic()
            engine.run("compose", "-p", PROJECT, "stop", log=log, ELMO_PORT=str(port))  # SIGTERM, 30 s' grace
            engine.seconds["stop"] = time.monotonic() - started
            state = json.loads(engine.run("inspect", ident).stdout)[0]["State"]
            logs = engine.run("logs", ident).stdout.decode()
            assert state["ExitCode"] == 0 and not state["OOMKilled"], logs[-3000:]
            assert "draining" in logs and "elmo.service: stopped" in logs  # its own shutdown, not a SIGKILL
            assert engine.seconds["stop"] < 30
        finally:
            engine.run("compose", "-p", PROJECT, "down", log=log, check=False, ELMO_PORT=str(port))
    leftover = engine.run("ps", "-a", "--filter", f"label=com.docker.compose.project={PROJECT}", "-q").stdout
    assert not leftover.strip()
    print(f"{engine.name}: " + ", ".join(f"{step} {s:.0f} s" for step, s in engine.seconds.items()))
    print(f"max abs error against elmo-embed: {error:.2e}; the engine's output: {log}")
