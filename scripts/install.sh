#!/usr/bin/env bash
# The one way this project is installed: `make install` (and so `make test`, `make serve` and CI) and both
# Docker images run this script, so CI exercises the images' install steps although it builds no image.
#
#   scripts/install.sh [--venv DIR] [--runtime cpu|gpu] [--export] [--otel] [--ray] [--dev] [--editable]
#                      [--lock FILE | --no-lock] [--log FILE] [--dry-run] [SOURCE]
#   scripts/install.sh --venv DIR --allennlp FOLDER [--log FILE] [--dry-run]
#
#   --venv DIR      create DIR with $PYTHON (default python3) if it is missing, and install into it
#                   (default: the python3 on PATH, or $PYTHON)
#   --runtime R     cpu: onnxruntime, gpu: onnxruntime-gpu (default cpu). Never both: they install the same
#                   module over each other, so the other one is uninstalled first.
#   --export        the build-time tools (elmo-export): torch 2.13.0 first, CPU build, so that nothing pulls
#                   another torch and gigabytes of CUDA packages; then onnx
#   --otel          the OpenTelemetry SDK and OTLP exporter: tracing, once OTEL_EXPORTER_OTLP_ENDPOINT is set
#   --ray           a Ray cluster's node (the `ray` image, deploy/kubernetes/bulk): the ray extra, for
#                   `elmo-embed --engine ray`, with Ray's dashboard (ray[default]), whose job API KubeRay submits
#                   the job to and whose agent it probes; locked to dev.txt (what the Ray tests ran with: the serve
#                   locks hold no Ray)
#   --dev           pytest, ruff and the other test tools, and the Python client (client/, elmo-client),
#                   whose tests run against the service
#   --editable      an editable install (a working copy); without it SOURCE is copied into the environment
#   --lock FILE     install the exact versions FILE pins (pip's constraints; `make lock` writes them), default:
#                   SOURCE/requirements/dev.txt with --dev, --export or --ray, else cpu.txt or gpu.txt by --runtime
#   --no-lock       the newest versions pyproject.toml's ranges allow, as a library user gets them
#   --log FILE      pip's output goes to FILE (appended), and the terminal gets one line per step; on a failure,
#                   the step, the last lines of FILE and its path (without --log: everything on the terminal)
#   --allennlp F    only this: allennlp 2.10.1 for the tests that compare with it (`make allennlp`), beside the
#                   venv's torch (installed first by --export): allennlp without its dependencies and the few small
#                   packages its ELMo code imports, in F/lib, and F/python, the venv's interpreter with F/lib first
#   --dry-run       print the commands, run nothing
#   SOURCE          the project folder (default: the folder above this script)
#
# Environment: PYTHON (the interpreter for a new venv), TORCH_INDEX_URL (where to get torch, e.g.
# https://download.pytorch.org/whl/cpu, whose torch wheels are CPU-only; default: pip's own configuration),
# ONNXRUNTIME (a pip requirement that pins the runtime, e.g. onnxruntime-gpu==1.26.0 for CUDA 12: it replaces the
# lock's pin of that package; the rest stays locked).
set -euo pipefail

TORCH="torch==2.13.0"
ALLENNLP=(allennlp==2.10.1 cached-path==1.1.6 rich==12.6.0 dill==0.4.1 base58==2.1.1 termcolor==1.1.0 lmdb==3.0.0)
allennlp=""
venv="" runtime="cpu" export_tools=0 otel=0 ray=0 dev=0 editable=0 dry_run=0 log="" lock="" locked=1
source_dir="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

die() {
    echo "install.sh: $*" >&2
    exit 2
}

while [ $# -gt 0 ]; do
    case "$1" in
        --venv) venv="${2:?--venv needs a folder}"; shift 2 ;;
        --runtime) runtime="${2:?--runtime needs cpu or gpu}"; shift 2 ;;
        --export) export_tools=1; shift ;;
        --otel) otel=1; shift ;;
        --ray) ray=1; shift ;;
        --dev) dev=1; shift ;;
        --editable) editable=1; shift ;;
        --log) log="${2:?--log needs a file}"; shift 2 ;;
        --lock) lock="${2:?--lock needs a file}"; shift 2 ;;
        --no-lock) locked=0; shift ;;
        --dry-run) dry_run=1; shift ;;
        --allennlp) allennlp="${2:?--allennlp needs a folder}"; shift 2 ;;
        -h | --help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        -*) die "unknown option $1 (see --help)" ;;
        *) source_dir="$1"; shift ;;
    esac
done

case "$runtime" in
    cpu) other="onnxruntime-gpu" ;;
    gpu) other="onnxruntime" ;;
    *) die "--runtime must be cpu or gpu, not '$runtime'" ;;
esac
[ -f "$source_dir/pyproject.toml" ] || die "$source_dir has no pyproject.toml: give the project folder"

# The lock: pip's constraints pin every package installed, whatever asks for it (a package it does not list floats).
constraints=()
if [ "$locked" = 1 ]; then
    if [ -z "$lock" ]; then
        if [ "$dev" = 1 ] || [ "$export_tools" = 1 ] || [ "$ray" = 1 ]; then lock="$source_dir/requirements/dev.txt"
        else lock="$source_dir/requirements/$runtime.txt"; fi
    fi
    [ -f "$lock" ] || die "$lock not found: give --lock FILE, run \`make lock\`, or --no-lock for pyproject's ranges"
    if [ -n "${ONNXRUNTIME:-}" ]; then
        # ONNXRUNTIME pins the runtime instead of the lock: the lock without that package's line
        name="$(printf '%s' "$ONNXRUNTIME" | sed 's/[=<>!~;[ ].*//')"
        filtered="$(mktemp)"
        trap 'rm -f "$filtered"' EXIT
        grep -v -i "^$name==" "$lock" >"$filtered" || true
        lock="$filtered"
    fi
    constraints=(-c "$lock")
fi

if [ -n "$log" ] && [ "$dry_run" = 0 ]; then
    mkdir -p "$(dirname "$log")"
    log="$(cd "$(dirname "$log")" && pwd)/$(basename "$log")"
    echo "== $(date -u '+%Y-%m-%d %H:%M:%S') scripts/install.sh" >>"$log"
fi

# run WHAT COMMAND...: the command, echoed. With --log, its output goes to the log and the terminal gets WHAT and its
# time; a failure shows the log's last lines and its path. HINT (set for one call) names a likely cause of a failure.
run() {
    local what="$1" started=$SECONDS status=0
    shift
    if [ "$dry_run" = 1 ]; then
        echo "+ $*"
        return
    fi
    if [ -z "$log" ]; then
        echo "+ $*"
        "$@" || status=$?
    else
        printf 'install: %s ... ' "$what"
        echo "+ $*" >>"$log"
        "$@" >>"$log" 2>&1 || status=$?
        if [ "$status" = 0 ]; then echo "$((SECONDS - started)) s"; else echo "failed"; fi
    fi
    if [ "$status" != 0 ]; then
        if [ -n "$log" ]; then
            tail -n 20 "$log" >&2
            echo "install.sh: $what failed (exit status $status); the whole output is in $log" >&2
        fi
        [ -z "${HINT:-}" ] || die "$HINT"
        exit "$status"
    fi
}

python="${PYTHON:-python3}"
if [ -n "$venv" ]; then
    if [ ! -x "$venv/bin/python" ]; then
        if [ "$dry_run" = 0 ]; then
            command -v "$python" >/dev/null || die "$python not found: install Python 3.10 or newer, or set PYTHON"
            "$python" -c 'import sys; sys.exit(sys.version_info < (3, 10))' ||
                die "$python is too old: Python 3.10 or newer is needed (set PYTHON to one)"
        fi
        HINT="could not create $venv: on Debian and Ubuntu, install python3-venv (apt-get install python3-venv)" \
            run "$venv, a virtual environment of $python" "$python" -m venv "$venv"
    fi
    python="$venv/bin/python"
fi
pip=("$python" -m pip install --disable-pip-version-check)

if [ -n "$allennlp" ]; then
    [ -n "$venv" ] || die "--allennlp needs --venv: the environment whose torch allennlp runs with"
    run "allennlp 2.10.1 in $allennlp/lib" "${pip[@]}" --no-deps --target "$allennlp/lib" "${ALLENNLP[@]}"
    wrapper='#!/bin/sh\nPYTHONPATH="%s${PYTHONPATH:+:$PYTHONPATH}" exec "%s" "$@"\n'
    if [ "$dry_run" = 1 ]; then
        echo "+ $allennlp/python: $python with $allennlp/lib first on its path"
    else  # absolute paths, the venv's own (not its interpreter's target): the tests run it from anywhere
        printf "$wrapper" "$(cd "$allennlp/lib" && pwd)" "$(cd "$venv/bin" && pwd)/python" >"$allennlp/python"
        chmod +x "$allennlp/python"
    fi
    exit 0
fi

run "pip, upgraded" "${pip[@]}" --upgrade pip
# The other runtime would overwrite (or be overwritten by) the one installed below.
if [ "$dry_run" = 1 ]; then
    echo "+ $python -m pip uninstall --yes $other  # if it is installed"
elif "$python" -m pip show --quiet "$other" 2>/dev/null; then
    run "$other removed (never beside $runtime's)" "$python" -m pip uninstall --yes "$other"
fi

extras="$runtime"
if [ "$export_tools" = 1 ]; then
    # torch alone and first: the project's `torch>=2.1` is then already met by the CPU build.
    # Without the lock: TORCH_INDEX_URL may hold none of the versions it pins for torch's own requirements; the
    # project's step below brings those to the lock's.
    run "$TORCH" "${pip[@]}" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "$TORCH"
    extras="$extras,export"
fi
[ "$otel" = 1 ] && extras="$extras,otel"
[ "$ray" = 1 ] && extras="$extras,ray"
[ "$dev" = 1 ] && extras="$extras,dev"

project=()
add() {
    if [ "$editable" = 1 ]; then project+=(-e "$1"); else project+=("$1"); fi
}
add "$source_dir[$extras]"
# The client is its own distribution (httpx and numpy only), installed beside the service to be tested with it.
[ "$dev" = 1 ] && add "$source_dir/client[hdf5]"
what="the service [$extras]"
[ "$dev" = 1 ] && what="$what and the client"
[ "$locked" = 1 ] && what="$what, locked"
run "$what, with what they need" "${pip[@]}" "${constraints[@]}" "${project[@]}" ${ONNXRUNTIME:+"$ONNXRUNTIME"}
