"""Static checks of what ships the service (no Docker engine or cluster needed): the Dockerfile, docker-compose.yml,
the Kubernetes manifests and the one install script that the Makefile, the images and so CI share."""

from __future__ import annotations

import ast
import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from service.api.tracing import EXIT_EXPORT_S
from service.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "docker" / "Dockerfile"
COMPOSE = ROOT / "docker-compose.yml"
KUBERNETES = ROOT / "deploy" / "kubernetes"
SETTINGS = [f"ELMO_{name.upper()}" for name in Settings.model_fields]


# ---- Dockerfile


@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[tuple[str, str]] = field(default_factory=list)  # (INSTRUCTION, arguments)
    args: dict[str, str] = field(default_factory=dict)

    def all(self, keyword: str) -> list[str]:
        return [rest for kw, rest in self.instructions if kw == keyword]


def substitute(text: str, values: dict[str, str]) -> str:
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: values.get(m[1] or m[2], m[0]), text)


def parse_dockerfile(path: Path) -> tuple[dict[str, str], list[Stage]]:
    """Global ARG defaults and the stages, continuation lines joined, comments dropped."""
    lines, current = [], ""
    for raw in path.read_text().splitlines():
        stripped = raw.strip()
        if stripped.startswith("#") or not stripped:
            continue
        if stripped.endswith("\\"):
            current += stripped[:-1] + " "
            continue
        lines.append(current + stripped)
        current = ""
    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    for line in lines:
        keyword, _, rest = line.partition(" ")
        keyword, rest = keyword.upper(), rest.strip()
        if keyword == "FROM":
            words = rest.split()
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else None
            stages.append(Stage(substitute(words[0], global_args), name))
            continue
        if keyword == "ARG":
            key, _, default = rest.partition("=")
            target = stages[-1].args if stages else global_args
            target[key] = global_args.get(key, "") if not default else default.strip('"')
            if not stages:
                continue
        stages[-1].instructions.append((keyword, rest))
    return global_args, stages


def copy_sources(rest: str) -> tuple[dict[str, str], list[str]]:
    """The flags and the sources of a COPY / ADD (shell or JSON form)."""
    words = shlex.split(rest)
    flags = dict(w[2:].partition("=")[::2] for w in words if w.startswith("--"))
    words = [w for w in words if not w.startswith("--")]
    if words and words[0].startswith("["):
        words = json.loads(rest[rest.index("[") :])
    return flags, words[:-1]


@pytest.fixture(scope="module")
def dockerfile():
    return parse_dockerfile(DOCKERFILE)


def test_dockerfile_stages(dockerfile):
    global_args, stages = dockerfile
    names = [s.name for s in stages]
    assert names == ["model", "export", "base-cpu", "base-gpu", "run"]
    run = stages[-1]
    assert run.base == "base-" + global_args["RUNTIME"] and global_args["RUNTIME"] == "cpu"
    gpu = stages[names.index("base-gpu")].base
    assert gpu.startswith("nvidia/cuda:") and "cudnn" in gpu and "runtime" in gpu  # CUDA and cuDNN libraries
    assert run.args["ONNXRUNTIME_GPU"].startswith("onnxruntime-gpu")
    # CUDA 13 and cuDNN 9 by default, with an onnxruntime-gpu built for them (1.27 and later)
    cuda = re.match(r"nvidia/cuda:(\d+)\.\d+\.\d+-cudnn-runtime-", global_args["CUDA_IMAGE"])
    assert cuda and cuda.group(1) == "13" and gpu == global_args["CUDA_IMAGE"]
    assert run.args["ONNXRUNTIME_GPU"] == "onnxruntime-gpu==1.31.1"  # pinned: a rebuild gets the runtime tested
    # CUDA 12 stays a build-argument choice, with the last onnxruntime-gpu built for it
    text = DOCKERFILE.read_text()
    assert "CUDA_IMAGE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04" in text
    assert "ONNXRUNTIME_GPU=onnxruntime-gpu==1.26.0" in text


def test_dockerfile_copy_sources_exist(dockerfile):
    _, stages = dockerfile
    ignored = {line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()}
    stage_names = {s.name for s in stages}
    checked = 0
    for stage in stages:
        for rest in stage.all("COPY") + stage.all("ADD"):
            flags, sources = copy_sources(rest)
            if "from" in flags:  # another stage, not the build context
                assert flags["from"] in stage_names, rest
                continue
            for source in sources:
                source = substitute(source, stage.args)
                assert (ROOT / source).exists(), f"COPY {source}: not in the build context"
                assert Path(source).parts[0] not in ignored, f"COPY {source}: excluded by .dockerignore"
                checked += 1
    assert checked >= 10


def test_run_stage_has_no_torch_a_user_and_a_health_check(dockerfile):
    _, stages = dockerfile
    export, run = stages[1], stages[-1]
    installs = [r for r in run.all("RUN") if "scripts/install.sh" in r]
    assert len(installs) == 1 and "--export" not in installs[0] and "torch" not in " ".join(run.all("RUN"))
    assert any("install.sh" in r and "--export" in r for r in export.all("RUN"))
    user = run.all("USER")[-1].split(":")[0]
    assert user not in ("root", "0") and user == "10001"
    (check,) = run.all("HEALTHCHECK")
    assert "/health/ready" in check and "ELMO_PORT" in check
    env = " ".join(run.all("ENV"))
    assert "ELMO_HOST=0.0.0.0" in env and "ELMO_PORT=8000" in env and run.all("EXPOSE") == ["8000"]
    assert "ELMO_MODEL_DIR=/opt/elmo/models/${MODEL_NAME}" in env and run.args["MODEL_NAME"] == "default"
    assert json.loads(run.all("CMD")[-1]) == ["elmo-serve"]


def test_every_install_goes_through_the_install_script(dockerfile):
    _, stages = dockerfile
    runs = [r for s in stages for r in s.all("RUN")]
    assert not [r for r in runs if "pip install" in r]  # the script does it
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^\t.*scripts/install\.sh .*--export --dev --editable", makefile, re.M)
    assert "pip install" not in makefile
    assert "make test" in (ROOT / ".ci" / "run").read_text()


def dry_run(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(ROOT / "scripts" / "install.sh"), "--dry-run", *args],
        capture_output=True,
        text=True,
        env={**os.environ, "ONNXRUNTIME": "", "TORCH_INDEX_URL": "", **env},
        check=False,
    )


def test_install_script_puts_torch_first_and_one_runtime():
    run = dry_run("--venv", "/opt/venv", "--runtime", "cpu", "--export", "--dev", "--editable")
    assert run.returncode == 0, run.stderr
    commands = [line for line in run.stdout.splitlines() if line.startswith("+ ")]
    assert commands[0].endswith("-m venv /opt/venv")
    torch = next(i for i, c in enumerate(commands) if "torch==2.13.0" in c)
    project = next(i for i, c in enumerate(commands) if "[cpu,export,dev]" in c)
    assert torch < project and " -e " in commands[project]
    assert f"-e {ROOT}/client[hdf5]" in commands[project]  # --dev: the Python client too, tested with the service
    assert any("uninstall --yes onnxruntime-gpu" in c for c in commands)

    run = dry_run("--venv", "/opt/venv", "--runtime", "gpu", str(ROOT), ONNXRUNTIME="onnxruntime-gpu==1.26.0")
    assert run.returncode == 0, run.stderr
    assert "torch" not in run.stdout and "uninstall --yes onnxruntime " in run.stdout
    assert run.stdout.rstrip().endswith("[gpu] onnxruntime-gpu==1.26.0")

    # the GPU image's default install step (CUDA 13), as the Dockerfile runs it
    run = dry_run("--venv", "/opt/venv", "--runtime", "gpu", str(ROOT), ONNXRUNTIME="onnxruntime-gpu==1.31.1")
    assert run.returncode == 0, run.stderr
    assert run.stdout.rstrip().endswith("[gpu] onnxruntime-gpu==1.31.1")

    run = dry_run("--export", TORCH_INDEX_URL="https://download.pytorch.org/whl/cpu")
    assert "--index-url https://download.pytorch.org/whl/cpu torch==2.13.0" in run.stdout

    run = dry_run("--runtime", "both")
    assert run.returncode == 2 and "--runtime must be cpu or gpu" in run.stderr


def test_install_script_with_a_log_prints_a_line_per_step_and_the_log_on_failure(tmp_path):
    # A stand-in interpreter in the venv: pip "succeeds" at upgrading itself and fails at torch, as pip would fail
    # without a network; what is tested is where the script sends pip's output, not pip.
    python = tmp_path / "venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    stub = ['case "$*" in *show*) exit 1;; esac', 'echo "pip output: $*"', 'case "$*" in *torch*) exit 3;; esac']
    python.write_text("#!/bin/sh\n" + "\n".join(stub) + "\n")
    python.chmod(0o755)
    log = tmp_path / "logs" / "install.log"
    run = subprocess.run(
        ["bash", str(ROOT / "scripts" / "install.sh"), "--venv", str(tmp_path / "venv"), "--export", "--log", str(log)],
        capture_output=True,
        text=True,
        env={**os.environ, "TORCH_INDEX_URL": ""},
        check=False,
    )
    assert run.returncode == 3
    assert run.stdout.splitlines() == ["install: pip, upgraded ... 0 s", "install: torch==2.13.0 ... failed"]
    assert "pip output: -m pip install --disable-pip-version-check torch==2.13.0" in run.stderr  # the log's tail
    assert run.stderr.rstrip().endswith(f"torch==2.13.0 failed (exit status 3); the whole output is in {log}")
    assert "pip output: -m pip install --disable-pip-version-check --upgrade pip" in log.read_text()


def export_script(tmp_path: Path, source: Path, cwd: Path = ROOT, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(ROOT / "docker" / "export-model.sh"), str(source), str(tmp_path / "out")],
        capture_output=True,
        text=True,
        cwd=cwd,
        env={**os.environ, "PYTHON": sys.executable, **env},
        check=False,
    )


def test_image_export_step_writes_a_model(tiny_dir, tmp_path):
    run = export_script(tmp_path, tiny_dir)  # options.json + lm_weights.hdf5 among other files
    assert run.returncode == 0, run.stderr
    assert json.loads((tmp_path / "out" / "manifest.json").read_text())["num_layers"] == 3


def test_image_export_step_exports_an_elmoformanylangs_folder(tmp_path):
    run = export_script(tmp_path, ROOT / "tests" / "fixtures" / "elmoformanylangs-tiny")
    assert run.returncode == 0, run.stderr
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["token_mapping"]["family"] == "elmoformanylangs" and (tmp_path / "out" / "word.dic").is_file()


def test_image_export_step_downloads_and_names_what_is_missing(tiny_dir, tmp_path):
    # A stand-in for elmo-export (first on the module path from cwd) shows what the script passes on.
    (tmp_path / "model_export").mkdir()
    (tmp_path / "model_export" / "__init__.py").write_text("")
    (tmp_path / "model_export" / "cli.py").write_text("import sys\nprint(sys.argv[1:])\n")
    urls = {"OPTIONS_URL": (tiny_dir / "options.json").as_uri(), "WEIGHTS_URL": (tiny_dir / "lm_weights.hdf5").as_uri()}
    run = export_script(
        tmp_path, tmp_path / "unused", cwd=tmp_path, TMPDIR=str(tmp_path), EXPORT_ARGS="--flag value", **urls
    )
    assert run.returncode == 0, run.stderr
    passed = ast.literal_eval(run.stdout.splitlines()[-1])
    assert passed[1].endswith("/options.json") and passed[3].endswith("/weights.hdf5")
    assert Path(passed[3]).read_bytes() == (tiny_dir / "lm_weights.hdf5").read_bytes()
    assert passed[4:] == ["--out", str(tmp_path / "out"), "--flag", "value"]

    run = export_script(tmp_path, tmp_path, cwd=tmp_path, OPTIONS_URL=urls["OPTIONS_URL"])
    assert run.returncode == 2 and "both OPTIONS_URL and WEIGHTS_URL" in run.stderr
    run = export_script(tmp_path, tmp_path, cwd=tmp_path)
    assert run.returncode == 2 and "expected one *options*.json and one *weights*.hdf5" in run.stderr


# ---- docker-compose.yml


def default(value) -> str:
    """A compose value with ${VAR:-default} interpolated as if VAR were unset."""
    return re.sub(r"\$\{\w+:?-([^}]*)\}", r"\1", str(value))


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def test_compose_cpu_service_is_what_docker_compose_up_starts(compose):
    cpu = compose["services"]["elmo"]
    assert "profiles" not in cpu  # started by a plain `docker compose up`
    assert (ROOT / cpu["build"]["context"] / cpu["build"]["dockerfile"]).resolve() == DOCKERFILE
    assert cpu["build"]["args"]["RUNTIME"] == "cpu"
    assert [default(p) for p in cpu["ports"]] == ["127.0.0.1:8000:8000"]  # loopback unless PUBLISH_ADDRESS says
    assert default(cpu["environment"]["ELMO_MODEL_DIR"]) == "/opt/elmo/models/default"  # the image's model
    assert default(cpu["environment"]["ELMO_HOST"]) == "0.0.0.0"


def test_compose_gpu_service_reserves_an_nvidia_device(compose):
    gpu = compose["services"]["elmo-gpu"]
    assert gpu["profiles"] == ["gpu"] and gpu["build"]["args"]["RUNTIME"] == "gpu"
    assert (ROOT / gpu["build"]["context"] / gpu["build"]["dockerfile"]).resolve() == DOCKERFILE
    (device,) = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and "gpu" in device["capabilities"] and device["count"] >= 1
    assert default(gpu["environment"]["ELMO_PROVIDER"]) == "cuda"
    assert default(gpu["ports"][0]).endswith(":8000")


def test_compose_has_one_replica_per_gpu(compose):
    first, second = compose["services"]["elmo-gpu"], compose["services"]["elmo-gpu-1"]
    assert second["profiles"] == ["gpu-2"] and second["build"] == first["build"] and second["image"] == first["image"]
    assert second["environment"] == first["environment"]  # ELMO_DEVICE_ID among them: the GPU seen is device 0
    (device,) = second["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and device["device_ids"] == ["1"] and "count" not in device
    assert [default(p) for p in second["ports"]] == ["127.0.0.1:8002:8000"] != [default(p) for p in first["ports"]]


@pytest.mark.parametrize("service", ["elmo", "elmo-gpu"])
def test_compose_health_models_volume_and_every_setting(compose, service):
    spec = compose["services"][service]
    assert any("/health/ready" in part for part in spec["healthcheck"]["test"])
    host, container, *_ = default(spec["volumes"][0]).split(":")
    assert container == "/models" and (ROOT / host).is_dir()  # an existing folder: compose creates none as root
    assert sorted(name for name in spec["environment"] if not name.startswith("OTEL_")) == sorted(SETTINGS)
    assert "OTEL_EXPORTER_OTLP_ENDPOINT" in spec["environment"]  # tracing, off until set


# ---- Kubernetes


def manifests(folder: Path) -> dict[str, dict]:
    docs = [d for path in sorted(folder.glob("*.yaml")) for d in yaml.safe_load_all(path.read_text()) if d]
    return {d["kind"]: d for d in docs}


@pytest.fixture(scope="module")
def kube() -> dict[str, dict]:
    return manifests(KUBERNETES / "gpu")


def test_kubernetes_manifests_parse_and_kustomize_lists_them(kube):
    kinds = {"Deployment", "Service", "HorizontalPodAutoscaler", "PodDisruptionBudget", "NetworkPolicy"}
    assert set(kube) == kinds | {"Kustomization"}
    for kind, doc in kube.items():
        assert doc["apiVersion"] and (kind == "Kustomization" or doc["metadata"]["name"] == "elmo")
    for resource in kube["Kustomization"]["resources"]:
        assert (KUBERNETES / "gpu" / resource).is_file()
    cpu = manifests(KUBERNETES / "cpu")["Kustomization"]
    assert [(KUBERNETES / "cpu" / r).resolve() for r in cpu["resources"]] == [(KUBERNETES / "gpu").resolve()]


def container_port(container: dict, port) -> int:
    """A probe's or Service's port, by number or by the container port's name."""
    by_name = {p.get("name"): p["containerPort"] for p in container["ports"]}
    return by_name[port] if isinstance(port, str) else port


def test_kubernetes_deployment_probes_the_real_health_routes(kube):
    from service.api.app import create_app

    routes = set(create_app(Settings()).openapi()["paths"])  # every route of every router
    pod = kube["Deployment"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    port = container["ports"][0]["containerPort"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert port == 8000 == int(env["ELMO_PORT"]) and env["ELMO_HOST"] == "0.0.0.0"
    probes = {name: container[name]["httpGet"] for name in ("livenessProbe", "readinessProbe", "startupProbe")}
    assert probes["livenessProbe"]["path"] == "/health/live" and probes["readinessProbe"]["path"] == "/health/ready"
    for probe in probes.values():
        assert probe["path"] in routes and container_port(container, probe["port"]) == port
    assert int(container["resources"]["limits"]["nvidia.com/gpu"]) >= 1
    assert env["ELMO_PROVIDER"] == "cuda"
    assert pod["securityContext"]["runAsNonRoot"] and pod["securityContext"]["runAsUser"] == 10001  # the image's
    labels = kube["Deployment"]["spec"]["template"]["metadata"]["labels"]
    assert kube["Deployment"]["spec"]["selector"]["matchLabels"].items() <= labels.items()


def test_kubernetes_service_and_autoscaler_point_at_the_deployment(kube):
    deployment = kube["Deployment"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    service = kube["Service"]["spec"]
    assert service["selector"].items() <= labels.items()
    (port,) = service["ports"]
    assert container_port(container, port["targetPort"]) == container["ports"][0]["containerPort"]
    hpa = kube["HorizontalPodAutoscaler"]["spec"]
    target = hpa["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", deployment["metadata"]["name"])
    assert 1 <= hpa["minReplicas"] <= hpa["maxReplicas"]
    assert kube["PodDisruptionBudget"]["spec"]["selector"]["matchLabels"].items() <= labels.items()


def test_kubernetes_pod_meets_the_restricted_pod_security_standard(kube):
    pod = kube["Deployment"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
    context = container["securityContext"]
    assert context["allowPrivilegeEscalation"] is False and context["capabilities"]["drop"] == ["ALL"]
    assert context["readOnlyRootFilesystem"] is True and "add" not in context["capabilities"]
    assert pod["automountServiceAccountToken"] is False  # the service never calls the Kubernetes API
    assert not any(key.startswith("host") for key in pod)  # hostNetwork, hostPID, hostIPC, hostPath...
    assert all("emptyDir" in volume for volume in pod["volumes"])


MARGIN_S = 10  # what the drain may overrun by (the last answers' writes, the batcher's stop) before a SIGKILL


def seconds(value) -> float:
    found = re.fullmatch(r"(\d+)(s?)", str(value))
    assert found, f"{value!r}: give seconds (45 or 45s)"
    return float(found[1])


def test_grace_periods_cover_the_pre_stop_pause_and_the_drain_with_a_margin(kube, compose):
    pod = kube["Deployment"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    drain = float(env.get("ELMO_DRAIN_S") or Settings.model_fields["drain_s"].default)
    command = container["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep"
    pause = float(command[1])
    # Kubernetes counts the grace period from the start of preStop: SIGTERM comes after it, SIGKILL at the end;
    # after the drain, the trace exporter may still send what it holds (each call bounded: EXIT_EXPORT_S at most).
    assert pod["terminationGracePeriodSeconds"] >= pause + drain + EXIT_EXPORT_S + MARGIN_S, (pause, drain)
    # compose sends SIGTERM at once and SIGKILL after stop_grace_period; the drain is the default unless set
    for name in ("elmo", "elmo-gpu"):
        assert seconds(compose["services"][name]["stop_grace_period"]) >= Settings().drain_s + EXIT_EXPORT_S + MARGIN_S


def test_prometheus_scrapes_the_metrics_port_which_needs_no_key(kube):
    template = kube["Deployment"]["spec"]["template"]
    (container,) = template["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    annotations = template["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true" and annotations["prometheus.io/path"] == "/metrics"
    port = int(env["ELMO_METRICS_PORT"])
    assert int(annotations["prometheus.io/port"]) == port == container_port(container, "metrics")
    assert int(env["ELMO_METRICS_PORT"]) != int(env["ELMO_PORT"])
    # the Service exposes the API alone: the metrics port is scraped pod by pod
    assert [port["targetPort"] for port in kube["Service"]["spec"]["ports"]] == ["http"]


def test_a_network_policy_admits_only_prometheus_to_the_metrics_port(kube):
    template = kube["Deployment"]["spec"]["template"]
    (container,) = template["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    policy = kube["NetworkPolicy"]["spec"]
    assert policy["podSelector"]["matchLabels"].items() <= template["metadata"]["labels"].items()  # the service's pods
    assert policy["policyTypes"] == ["Ingress"]  # every port not named below: nothing admitted
    admitted: dict[int, list] = {}  # container port -> who may connect to it (None: anyone)
    for rule in policy["ingress"]:
        assert rule.get("ports"), rule  # a rule without ports would admit its peers to every port
        for port in rule["ports"]:
            assert port.get("protocol", "TCP") == "TCP"
            admitted.setdefault(container_port(container, port["port"]), []).append(rule.get("from"))
    api, metrics = int(env["ELMO_PORT"]), int(env["ELMO_METRICS_PORT"])
    assert set(admitted) == {api, metrics}
    assert admitted[api] == [None]  # the API: from anywhere, as without a policy (the Service, the probes)
    (peers,) = admitted[metrics]
    (peer,) = peers  # one peer: the namespace and the pods in one element, so both must match
    assert set(peer) == {"namespaceSelector", "podSelector"}  # no ipBlock
    assert peer["namespaceSelector"] == {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}
    assert peer["podSelector"] == {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}
    # the CPU overlay renders the GPU one's resources, the policy among them
    assert "networkpolicy.yaml" in kube["Kustomization"]["resources"]


def test_image_tags_are_the_version_and_runtime_set_through_kustomize(kube, compose):
    from service import __version__

    (container,) = kube["Deployment"]["spec"]["template"]["spec"]["containers"]
    assert container["image"] == "elmo-service"  # kustomize's `images` gives the tag
    for overlay, runtime in (("gpu", "gpu"), ("cpu", "cpu")):
        (image,) = manifests(KUBERNETES / overlay)["Kustomization"]["images"]
        assert image == {"name": "elmo-service", "newTag": f"{__version__}-{runtime}"}, overlay
    assert compose["services"]["elmo"]["image"] == f"elmo-service:{__version__}-cpu"
    assert compose["services"]["elmo-gpu"]["image"] == f"elmo-service:{__version__}-gpu"
    run = subprocess.run(["make", "-n", "-C", str(ROOT), "image", "RUNTIME=gpu"], capture_output=True, text=True,
                         check=True)  # fmt: skip
    assert f"-t elmo-service:{__version__}-gpu ." in run.stdout


# ---- the docs


def test_the_docs_document_every_setting():
    table = (ROOT / "docs" / "configuration.md").read_text()
    missing = [name for name in SETTINGS if f"`{name}`" not in table]
    assert not missing, f"docs/configuration.md's table of settings lacks {missing}"


@pytest.mark.parametrize(
    "env",
    [{}, {"ELMO_MODELS": "a=/m/a,b=/m/b"}, {"ELMO_MODEL_DIR": "/m/a"}],
    ids=["default-model", "ELMO_MODELS", "ELMO_MODEL_DIR"],
)
def test_make_serve_needs_no_torch_and_leaves_the_models_to_elmo_variables(env):
    # `make serve` passed --model always, so ELMO_MODELS made elmo-serve exit 1 ("both ELMO_MODELS and ..."). It
    # now serves the export the package ships (no --model at all) and installs no export tools: no torch.
    clean = {k: v for k, v in os.environ.items() if not k.startswith("ELMO_")}
    run = subprocess.run(["make", "-n", "-B", "-C", str(ROOT), "serve", "VENV=/nonexistent/venv"], capture_output=True,
                         text=True, env={**clean, **env}, check=True)  # fmt: skip
    lines = run.stdout.splitlines()
    (serve,) = [line for line in lines if "elmo-serve" in line]
    assert "--model" not in serve and "elmo-export" not in run.stdout, serve
    (install,) = [line for line in lines if "scripts/install.sh" in line]
    assert "--export" not in install and "torch" not in run.stdout, install
