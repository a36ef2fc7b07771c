"""pip install, then serve: the sdist and wheel built as a maintainer publishes them (python -m build, twine check
--strict), the wheel installed into a fresh virtual environment with the CPU lock (no torch), and its elmo-serve,
with no model named, answering /embed with the embedded default model's numbers. About a minute (the venv's
packages come from pip's cache after the first run)."""

from __future__ import annotations

import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import httpx
import numpy as np
import pytest

from service import __version__
from service.engine.session import Engine
from service.settings import DEFAULT_MODEL_DIR
from tests.live_server import free_port, stop, wait_ready

ROOT = Path(__file__).resolve().parents[2]
SENTENCES = [["The", "bank", "of", "the", "river", "."], ["Hello"]]
EXPLORE_FILES = ["index.html", "app.js", "vectors.js", "explore.css"]


def run(*command: str | Path, **kwargs) -> subprocess.CompletedProcess:
    done = subprocess.run([str(c) for c in command], capture_output=True, text=True, check=False, **kwargs)
    assert done.returncode == 0, f"{' '.join(map(str, command))}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    run(sys.executable, "-m", "build", "--outdir", out, ROOT)  # the sdist, then the wheel built from it
    run(Path(sys.executable).with_name("twine"), "check", "--strict", *out.iterdir())
    return out


def test_the_wheel_holds_the_service_its_licence_the_default_model_and_the_kernel(dist):
    # a wheel of this platform: it holds the compiled kernels (service/engine/native/)
    (wheel,) = dist.glob(f"elmo_service-{__version__}-cp{sys.version_info.major}{sys.version_info.minor}-*.whl")
    (sdist,) = dist.glob(f"elmo_service-{__version__}.tar.gz")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        metadata = archive.read(f"elmo_service-{__version__}.dist-info/METADATA").decode()
    assert [n for n in names if n.startswith("service/engine/native/_ops.") and n.endswith(".so")]
    with tarfile.open(sdist) as archive:  # and the sdist its source, for a platform without a wheel
        assert f"elmo_service-{__version__}/service/engine/native/ops.cc" in archive.getnames()
    shipped = {f"service/embedded/default/{p.name}" for p in DEFAULT_MODEL_DIR.iterdir()}
    shipped |= {f"service/api/explore/{name}" for name in EXPLORE_FILES}  # the /explore page, package data too
    assert shipped <= names and f"elmo_service-{__version__}.dist-info/licenses/LICENSE" in names
    assert "License-Expression: Apache-2.0" in metadata and "Classifier: Framework :: FastAPI" in metadata
    assert "Provides-Extra: otel" in metadata and "Requires-Dist: torch" in metadata  # torch: the export extra only
    assert not [n for n in names if "/tests/" in n or n.startswith(("tests/", "bench/", "client/"))]
    print(f"wheel {wheel.stat().st_size / 1e6:.1f} MB, sdist {sdist.stat().st_size / 1e6:.1f} MB")


def test_the_client_is_packaged_likewise(tmp_path):
    from elmo_client import __version__ as client_version

    run(sys.executable, "-m", "build", "--outdir", tmp_path, ROOT / "client")
    built = sorted(p.name for p in tmp_path.iterdir())
    assert built == [f"elmo_client-{client_version}-py3-none-any.whl", f"elmo_client-{client_version}.tar.gz"]
    run(Path(sys.executable).with_name("twine"), "check", "--strict", *tmp_path.iterdir())
    with zipfile.ZipFile(tmp_path / built[0]) as archive:
        metadata = archive.read(f"elmo_client-{client_version}.dist-info/METADATA").decode()
        assert f"elmo_client-{client_version}.dist-info/licenses/LICENSE" in archive.namelist()
    assert "License-Expression: Apache-2.0" in metadata and "Requires-Dist: httpx" in metadata
    assert "fastapi" not in metadata and "onnxruntime" not in metadata  # the client needs none of the server's


def test_pip_install_the_wheel_then_serve_the_default_model_without_torch(dist, tmp_path):
    (wheel,) = dist.glob("elmo_service-*.whl")
    venv = tmp_path / "venv"
    run(sys.executable, "-m", "venv", venv)
    python = venv / "bin" / "python"
    run(python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "-c",
        ROOT / "requirements" / "cpu.txt", f"{wheel}[cpu]")  # fmt: skip
    assert subprocess.run([python, "-c", "import torch"], capture_output=True, check=False).returncode != 0
    assert run(venv / "bin" / "elmo-serve", "--version").stdout.strip() == f"elmo-serve {__version__}"

    port = free_port()
    log = tmp_path / "serve.log"
    env = {"PATH": f"{venv / 'bin'}:/usr/bin:/bin", "ELMO_PORT": str(port), "ELMO_INTRA_OP_THREADS": "1"}
    with log.open("wb") as out:  # from elsewhere than the checkout: the package's own files alone
        proc = subprocess.Popen([venv / "bin" / "elmo-serve"], stdout=out, stderr=subprocess.STDOUT, cwd=tmp_path,
                                env=env)  # fmt: skip
    try:
        url = f"http://127.0.0.1:{port}"
        wait_ready(proc, url, log)
        info = httpx.get(f"{url}/info", timeout=30).json()
        assert info["version"] == __version__ and info["model"] == "default"
        assert info["kernels"] is True, info  # the wheel's own kernels, loaded
        answer = httpx.post(f"{url}/embed", json={"sentences": SENTENCES, "output": "layers"}, timeout=60)
        assert answer.status_code == 200, answer.text
        page = httpx.get(f"{url}/explore")  # the page's files, from the installed package
        assert page.status_code == 200 and 'src="explore/app.js"' in page.text
        assert httpx.get(f"{url}/explore/app.js").content == (ROOT / "service/api/explore/app.js").read_bytes()
    finally:
        assert stop(proc) == 0, log.read_text()
    served = [np.asarray(item["embedding"], dtype=np.float32) for item in answer.json()["data"]]
    want = Engine(DEFAULT_MODEL_DIR, provider="cpu", intra_op_threads=1).run(SENTENCES)
    assert max(float(np.abs(s - w).max()) for s, w in zip(served, want, strict=True)) <= 1e-5
    assert "site-packages/service/embedded/default" in log.read_text()  # served from the installed wheel
