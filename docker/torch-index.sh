#!/usr/bin/env bash
# A local package index of torch 2.13.0 and what it depends on, for the image's build stage where the PyTorch
# index cannot be reached: the wheels pip finds for torch==2.13.0 here (its configured indexes and find-links; a
# CPU build must be among them, or pip takes PyPI's CUDA one), laid out as a PEP 503 index (one folder per
# project), which any static file server serves (`python3 -m http.server -d DIR -b 127.0.0.1 PORT`).
#
#   docker/torch-index.sh DIR [PYTHON_VERSION]     PYTHON_VERSION: the image's Python (default 3.11: Debian
#                                                  bookworm's, that of docker/base-image.sh)
#
# Then: docker build --network host --build-arg TORCH_INDEX_URL=http://127.0.0.1:PORT/ ... (README, "Docker and
# compose": building offline). Environment: PYTHON (the interpreter whose pip downloads; default python3).
set -euo pipefail

[ $# -ge 1 ] || { echo "usage: $0 DIR [PYTHON_VERSION]" >&2; exit 2; }
out="$1" version="${2:-3.11}"
python="${PYTHON:-python3}"
wheels="$(mktemp -d)"
trap 'rm -rf "$wheels"' EXIT

"$python" -m pip download --quiet --disable-pip-version-check --only-binary=:all: --python-version "$version" \
    --platform manylinux_2_28_x86_64 --implementation cp -d "$wheels" torch==2.13.0
case "$(ls "$wheels"/torch-*)" in
    *+cpu*) ;;
    *) echo "torch-index.sh: the torch found is not a CPU build: $(ls "$wheels"/torch-*)" >&2; exit 1 ;;
esac
rm -rf "$out"
for wheel in "$wheels"/*.whl; do
    # the project's name as PEP 503 normalizes it: lower case, runs of - _ . as one -
    name="$(basename "$wheel" | cut -d- -f1 | tr 'A-Z_.' 'a-z--' | tr -s -)"
    mkdir -p "$out/$name"
    cp "$wheel" "$out/$name/"
done
echo "torch-index.sh: $(ls "$out" | wc -l) projects in $out: $(ls "$out" | tr '\n' ' ')"
