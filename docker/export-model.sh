#!/usr/bin/env bash
# Export the biLM in SOURCE_DIR (its options.json and weights.hdf5, as published: one *options*.json and one
# *weights*.hdf5; or an ELMoForManyLangs folder) to OUT_DIR with elmo-export. The image's build stage runs this to bake a model in.
#
#   docker/export-model.sh SOURCE_DIR OUT_DIR
#
# Environment: OPTIONS_URL and WEIGHTS_URL (both or neither): download the two files instead of reading
# SOURCE_DIR; EXPORT_ARGS: more elmo-export flags; PYTHON: the interpreter that has model_export (default python).
set -euo pipefail

die() {
    echo "export-model.sh: $*" >&2
    exit 2
}

[ $# -eq 2 ] || die "usage: $0 SOURCE_DIR OUT_DIR"
source_dir="$1" out="$2"
python="${PYTHON:-python}"

if [ -n "${OPTIONS_URL:-}${WEIGHTS_URL:-}" ]; then
    [ -n "${OPTIONS_URL:-}" ] && [ -n "${WEIGHTS_URL:-}" ] || die "set both OPTIONS_URL and WEIGHTS_URL, or neither"
    source_dir="$(mktemp -d)"
    download() {
        echo "downloading $1"
        "$python" -c 'import sys, urllib.request; urllib.request.urlretrieve(sys.argv[1], sys.argv[2])' "$1" "$2"
    }
    download "$OPTIONS_URL" "$source_dir/options.json"
    download "$WEIGHTS_URL" "$source_dir/weights.hdf5"
fi

# An ELMoForManyLangs folder (config.json, char.dic, word.dic, *.pkl): elmo-export tells it by its files.
if [ -f "$source_dir/char.dic" ] && [ -f "$source_dir/encoder.pkl" ]; then
    # shellcheck disable=SC2086  # EXPORT_ARGS is a list of flags
    exec "$python" -m model_export.cli "$source_dir" --format elmoformanylangs --out "$out" ${EXPORT_ARGS:-}
fi

shopt -s nullglob
options=("$source_dir"/*options*.json)
weights=("$source_dir"/*weights*.hdf5)
if [ ${#options[@]} -ne 1 ] || [ ${#weights[@]} -ne 1 ]; then
    die "expected one *options*.json and one *weights*.hdf5 in $source_dir, found: ${options[*]:-no options} ${weights[*]:-no weights}"
fi

# shellcheck disable=SC2086  # EXPORT_ARGS is a list of flags
exec "$python" -m model_export.cli --options "${options[0]}" --weights "${weights[0]}" --out "$out" ${EXPORT_ARGS:-}
