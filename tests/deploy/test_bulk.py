"""Static checks of the bulk-embedding manifests (deploy/kubernetes/bulk: a KubeRay RayJob and an Indexed Job of
shards, on one shared volume) and of scripts/validate_crd.py, which `make lint` validates the RayJob with. Their
commands are parsed by elmo-embed's own parser, so a flag that elmo-embed does not take fails here."""

from __future__ import annotations

import fnmatch
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
import yaml

from service.cli import _embed_args, _embed_parser
from tests.deploy.test_deploy import DOCKERFILE, ROOT, parse_dockerfile

BULK = ROOT / "deploy" / "kubernetes" / "bulk"
CRD = ROOT / "deploy" / "kubernetes" / "crds" / "ray.io_rayjobs.json"
VALIDATE = ROOT / "scripts" / "validate_crd.py"


def rendered() -> list[dict]:
    """What `kustomize build deploy/kubernetes/bulk` renders: its resources as they are (it transforms nothing;
    the test below keeps it so), in its order."""
    kustomization = yaml.safe_load((BULK / "kustomization.yaml").read_text())
    return [d for name in kustomization["resources"] for d in yaml.safe_load_all((BULK / name).read_text()) if d]


@pytest.fixture(scope="module")
def bulk() -> dict[str, dict]:
    return {doc["kind"]: doc for doc in rendered()}


def test_the_kustomization_renders_the_volume_and_both_jobs_untransformed(bulk):
    kustomization = yaml.safe_load((BULK / "kustomization.yaml").read_text())
    assert set(kustomization) == {"apiVersion", "kind", "resources"}  # rendered() is then what kustomize renders
    assert set(bulk) == {"PersistentVolumeClaim", "RayJob", "Job"} and len(rendered()) == 3
    assert bulk["RayJob"]["apiVersion"] == "ray.io/v1" and bulk["Job"]["apiVersion"] == "batch/v1"
    # both created suspended: nothing runs before the input is on the volume and one of them is resumed
    assert bulk["RayJob"]["spec"]["suspend"] is True and bulk["Job"]["spec"]["suspend"] is True
    assert bulk["PersistentVolumeClaim"]["spec"]["accessModes"] == ["ReadWriteMany"]  # pods on several nodes


def ray_pods(rayjob: dict) -> dict[str, dict]:
    cluster = rayjob["spec"]["rayClusterSpec"]
    pods = {"head": cluster["headGroupSpec"]["template"]["spec"]}
    pods |= {group["groupName"]: group["template"]["spec"] for group in cluster["workerGroupSpecs"]}
    return pods


def mounts(pod: dict) -> dict[str, str]:
    """mount path -> the claim mounted there, for the pod's one container."""
    (container,) = pod["containers"]
    claims = {
        v["name"]: v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"] if v.get("persistentVolumeClaim")
    }
    return {m["mountPath"]: claims[m["name"]] for m in container["volumeMounts"] if m["name"] in claims}


def test_the_rayjob_runs_elmo_embed_on_its_cluster_resumably_and_deletes_the_cluster(bulk):
    spec = bulk["RayJob"]["spec"]
    argv = shlex.split(spec["entrypoint"])
    assert argv[0] == "elmo-embed"
    args = _embed_args(_embed_parser(), argv[1:])  # elmo-embed's own checks of its flags
    assert args.engine == "ray" and args.address == "auto" and args.resume is True
    assert spec["shutdownAfterJobFinishes"] is True and spec["ttlSecondsAfterFinished"] >= 0
    assert spec["backoffLimit"] >= 1  # a retry, on a fresh cluster: --resume continues from the parts written
    # the actors fit the workers' CPUs: --actors x --threads CPUs, the head taking none (num-cpus 0)
    cluster = spec["rayClusterSpec"]
    assert cluster["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"
    cpus = sum(int(g["replicas"]) * int(g["template"]["spec"]["containers"][0]["resources"]["limits"]["cpu"])
               for g in cluster["workerGroupSpecs"])  # fmt: skip
    assert args.actors * args.threads == cpus, (args.actors, args.threads, cpus)
    for group in cluster["workerGroupSpecs"]:
        assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
    # no dashboard outside the cluster: no Ingress, a ClusterIP Service
    assert cluster["headGroupSpec"]["enableIngress"] is False and cluster["headGroupSpec"]["serviceType"] == "ClusterIP"


def test_every_ray_pod_mounts_the_one_volume_where_the_entrypoint_reads_and_writes(bulk):
    spec = bulk["RayJob"]["spec"]
    claim = bulk["PersistentVolumeClaim"]["metadata"]["name"]
    pods = ray_pods(bulk["RayJob"])
    assert len(pods) >= 2  # the head and a worker group
    seen = {name: mounts(pod) for name, pod in pods.items()}
    assert all(found == {"/data": claim} for found in seen.values()), seen  # the same claim at the same path
    args = _embed_args(_embed_parser(), shlex.split(spec["entrypoint"])[1:])
    for path in [*args.input, args.output]:
        assert path.startswith("/data/"), path
    # the model: the one baked into the image, at the same path in every pod (they all run the same image)
    _, stages = parse_dockerfile(DOCKERFILE)
    (env,) = [rest for keyword, rest in stages[-1].instructions if keyword == "ENV" and "ELMO_MODEL_DIR" in rest]
    baked = re.search(r"ELMO_MODEL_DIR=(\S+)", env)[1].replace("${MODEL_NAME}", stages[-1].args["MODEL_NAME"])
    assert str(args.model) == baked
    images = {pod["containers"][0]["image"] for pod in [*pods.values(), spec["submitterPodTemplate"]["spec"]]}
    assert images == {"elmo-service:0.1.0-cpu-ray"}


def test_every_ray_pod_reports_no_usage_and_meets_the_restricted_standard(bulk):
    pods = ray_pods(bulk["RayJob"]) | {"submitter": bulk["RayJob"]["spec"]["submitterPodTemplate"]["spec"]}
    for name, pod in pods.items():
        (container,) = pod["containers"]
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env["RAY_USAGE_STATS_ENABLED"] == "0", name
        context = pod["securityContext"]
        assert context["runAsNonRoot"] is True and context["runAsUser"] == 10001, name  # the image's user
        assert context["seccompProfile"] == {"type": "RuntimeDefault"}, name
        assert container["securityContext"]["allowPrivilegeEscalation"] is False, name
        assert container["securityContext"]["capabilities"]["drop"] == ["ALL"], name
        assert pod["automountServiceAccountToken"] is False, name
        assert container["resources"]["limits"]["memory"] and container["resources"]["requests"]["cpu"], name


def test_the_indexed_job_runs_shard_index_of_n_with_n_its_completions(bulk):
    spec = bulk["Job"]["spec"]
    n = spec["completions"]
    assert spec["completionMode"] == "Indexed" and 1 <= spec["parallelism"] <= n
    assert spec["backoffLimitPerIndex"] >= 1 and 0 <= spec["maxFailedIndexes"] <= n
    pod = spec["template"]["spec"]
    assert pod["restartPolicy"] == "Never"  # what podFailurePolicy and a per-index retry need
    (container,) = pod["containers"]
    command = container["command"]
    assert command[0] == "elmo-embed" and command[command.index("--shard") + 1] == f"$(JOB_COMPLETION_INDEX)/{n}"
    outputs = set()
    for index in range(n):  # as Kubernetes substitutes $(VAR) for each pod
        env = {"JOB_COMPLETION_INDEX": str(index), "THREADS": container["resources"]["limits"]["cpu"]}
        argv = [re.sub(r"\$\((\w+)\)", lambda m: env[m[1]], word) for word in command[1:]]  # noqa: B023
        args = _embed_args(_embed_parser(), argv)
        assert (args.shard.index, args.shard.count) == (index, n) and args.engine == "local"
        assert args.threads == int(container["resources"]["limits"]["cpu"])
        outputs.add(args.output)
    assert len(outputs) == n  # a file per shard
    (threads,) = [e for e in container["env"] if e["name"] == "THREADS"]
    assert threads["valueFrom"]["resourceFieldRef"] == {"containerName": "embed", "resource": "limits.cpu"}
    assert mounts(pod) == {"/data": bulk["PersistentVolumeClaim"]["metadata"]["name"]}
    assert all(path.startswith("/data/") for path in outputs)
    # the README's merge takes exactly these files
    merge = re.search(r"^elmo-embed merge (.+)$", (BULK / "README.md").read_text(), re.M)[1]
    pattern, _ = shlex.split(merge)
    assert all(fnmatch.fnmatch(path, pattern) for path in outputs)


def test_the_indexed_job_fails_a_shard_at_once_on_elmo_embed_s_own_errors_and_not_on_a_drain(bulk):
    spec = bulk["Job"]["spec"]
    rules = spec["podFailurePolicy"]["rules"]
    fail = [r for r in rules if r["action"] == "FailIndex"]
    ((codes,),) = [[r["onExitCodes"]] for r in fail]
    assert codes["containerName"] == spec["template"]["spec"]["containers"][0]["name"]
    assert codes["operator"] == "In" and set(codes["values"]) == {1, 2}  # elmo-embed's error, its arguments'
    assert 143 not in codes["values"] and 137 not in codes["values"]  # SIGTERM, SIGKILL: retried
    (ignore,) = [r for r in rules if r["action"] == "Ignore"]
    assert ignore["onPodConditions"] == [{"type": "DisruptionTarget"}]


# ---- the image with Ray


def test_the_ray_image_is_a_build_argument_that_leaves_the_default_image_as_it_was():
    _, stages = parse_dockerfile(DOCKERFILE)
    run = stages[-1]
    assert run.args["RAY"] == ""  # default: the serving image, no Ray
    (install,) = [r for r in run.all("RUN") if "scripts/install.sh" in r]
    assert 'if [ "$RAY" = 1 ]; then set -- --ray; fi' in install and ' --otel "$@" /tmp/src' in install
    made = subprocess.run(["make", "-n", "-C", str(ROOT), "image", "RAY=1"], capture_output=True, text=True,
                          check=True)  # fmt: skip
    assert "--build-arg RAY=1 -t elmo-service:0.1.0-cpu-ray ." in made.stdout
    made = subprocess.run(["make", "-n", "-C", str(ROOT), "image"], capture_output=True, text=True, check=True)
    assert "RAY" not in made.stdout and "-t elmo-service:0.1.0-cpu ." in made.stdout


def test_the_install_script_s_ray_step_adds_the_extra_locked_to_dev():
    def project(*args: str) -> str:
        run = subprocess.run(["bash", str(ROOT / "scripts" / "install.sh"), "--dry-run", *args], capture_output=True,
                             text=True, env={"PATH": "/usr/bin:/bin", "ONNXRUNTIME": ""}, check=True)  # fmt: skip
        return [line for line in run.stdout.splitlines() if " install " in line][-1]

    ray = project("--venv", "/opt/venv", "--runtime", "cpu", "--otel", "--ray", str(ROOT))
    assert ray.endswith(f"-c {ROOT}/requirements/dev.txt {ROOT}[cpu,otel,ray]"), ray  # the dashboard: the extra's
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["ray"]
    assert any(r.startswith("ray[") and "default" in r and "data" in r for r in extra)  # locked in dev.txt
    serve = project("--venv", "/opt/venv", "--runtime", "cpu", "--otel", str(ROOT))  # the default image's step
    assert serve.endswith(f"-c {ROOT}/requirements/cpu.txt {ROOT}[cpu,otel]"), serve


# ---- scripts/validate_crd.py


def validate(tmp_path: Path, docs: list[dict]) -> subprocess.CompletedProcess:
    path = tmp_path / "rendered.yaml"
    path.write_text(yaml.safe_dump_all(docs))
    return subprocess.run([sys.executable, str(VALIDATE), "--crd", str(CRD), "--rest", str(tmp_path / "rest.yaml"),
                           str(path)], capture_output=True, text=True, check=False)  # fmt: skip


def test_the_crd_validator_passes_the_rayjob_and_leaves_the_native_objects_to_kubernetes_validate(tmp_path):
    run = validate(tmp_path, rendered())
    assert run.returncode == 0, run.stderr
    assert "1 custom resources valid, 2 left for the rest" in run.stdout
    rest = [d["kind"] for d in yaml.safe_load_all((tmp_path / "rest.yaml").read_text())]
    assert sorted(rest) == ["Job", "PersistentVolumeClaim"]


def rayjob() -> dict:
    return next(d for d in rendered() if d["kind"] == "RayJob")


def worker(spec: dict) -> dict:
    return spec["rayClusterSpec"]["workerGroupSpecs"][0]


WORKER = ".spec.rayClusterSpec.workerGroupSpecs[0]"


@pytest.mark.parametrize(
    ("change", "where", "message"),
    [
        (lambda s: s.update(shutdownAfterJobFinished=True), ".spec", "'shutdownAfterJobFinished' was unexpected"),
        (
            lambda s: worker(s)["template"]["spec"]["containers"][0].update(mountPath="/data"),
            f"{WORKER}.template.spec.containers[0]",
            "'mountPath' was unexpected",
        ),
        (lambda s: worker(s).update(replicas="four"), f"{WORKER}.replicas", "'four' is not of type 'integer'"),
        (lambda s: worker(s).pop("groupName"), WORKER, "'groupName' is a required property"),
    ],
    ids=["unknown-field", "unknown-nested-field", "wrong-type", "missing-required"],
)
def test_the_crd_validator_refuses_a_rayjob_the_api_server_would_change_or_refuse(tmp_path, change, where, message):
    doc = rayjob()
    change(doc["spec"])
    run = validate(tmp_path, [doc])
    assert run.returncode == 1
    assert f"RayJob elmo-embed: {where}: " in run.stderr and message in run.stderr, run.stderr


def test_the_crd_validator_refuses_unknown_metadata_and_takes_quantities_as_numbers_or_strings(tmp_path):
    doc = rayjob()
    doc["metadata"]["label"] = {"a": "b"}
    run = validate(tmp_path, [doc])
    assert run.returncode == 1 and "RayJob elmo-embed: .metadata: " in run.stderr and "'label'" in run.stderr
    doc = rayjob()
    resources = doc["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["resources"]
    resources["limits"]["cpu"] = 8  # x-kubernetes-int-or-string: 8 or "8"
    assert validate(tmp_path, [doc]).returncode == 0


def test_the_crd_validator_fails_when_there_is_no_rayjob_to_validate(tmp_path):
    run = validate(tmp_path, [d for d in rendered() if d["kind"] != "RayJob"])
    assert run.returncode == 2 and "no RayJob to validate" in run.stderr
