#!/usr/bin/env bash
# The GPU training plan (README: "Training on a GPU"), in steps that each fit in one 10-minute call of the lent
# GPU machine, resuming from the checkpoint that the machine keeps under build/ while it stays warm.
#
# Here, before (needs the corpus packages: make corpus-packages):
#   make gpu-carry              # build/corpus-all.tar.xz (about 20 MB) and build/gpu-wheels/ (tqdm)
# On the GPU machine, each through the device tool's run, with carry ["build/corpus-all.tar.xz", "build/gpu-wheels"],
# back to back so that the machine stays warm:
#   scripts/gpu-train.sh sweep  # unpack, check, train elmo-small and elmo-small-wide for SWEEP_MINUTES each
#                               # (stopped in their warm-up), keep the lower held-out perplexity, size the epochs
#   scripts/gpu-train.sh train  # TRAIN_CALL_MINUTES more of the winner; repeat until it prints "finished";
#                               # the finishing call evaluates and puts the model into $OUT
# Here, after:
#   scripts/gpu-train.sh fetch DIR   # DIR: the files_at folder of the finishing call -> build/gpu-model/, checked,
#                                    # its curve plotted, exported, and training.probes.senses / training.probes.syntax run on it
# Without a sweep (all the time to the published small shape): SWEEP=0 scripts/gpu-train.sh sweep.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PY:-python3}
RUN=build/gpu
CORPUS=build/corpus-all
CONFIGS=${CONFIGS:-"elmo-small elmo-small-wide"}
SWEEP=${SWEEP:-1}
SWEEP_STEPS=${SWEEP_STEPS:-400}           # at most the configs' warm-up (400 steps): see training/sweep.py
SWEEP_MINUTES=${SWEEP_MINUTES:-2.5}       # per candidate
TRAIN_MINUTES=${TRAIN_MINUTES:-16}        # the whole run's training time, the sweep's share of the winner included
TRAIN_CALL_MINUTES=${TRAIN_CALL_MINUTES:-7.5}  # per call: loading (~20 s) and the final evaluation (~2 min) fit
PRECISION=${PRECISION:-bf16}
OUT=${OUT:-build/gpu-out}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}

log() { echo "gpu-train: $*" >&2; }
die() {
    log "$*"
    exit 1
}

setup() {
    mkdir -p "$RUN" "$OUT"
    if ! $PY -c "import tqdm" 2>/dev/null; then  # a pure-Python wheel imports from the zip as it is
        PYTHONPATH=$PYTHONPATH:$(ls "$PWD"/build/gpu-wheels/tqdm-*.whl)
        export PYTHONPATH
    fi
    $PY -c "import torch; assert torch.cuda.is_available(), 'torch sees no GPU'; \
print('torch', torch.__version__, torch.cuda.get_device_name(0))"
    if [ ! -f "$CORPUS/manifest.json" ]; then
        [ -f build/corpus-all.tar.xz ] || { log "carry build/corpus-all.tar.xz (make gpu-carry)"; exit 1; }
        tar -C build -xJf build/corpus-all.tar.xz
    fi
    $PY - <<'EOF'
import hashlib, json, pathlib
root = pathlib.Path("build/corpus-all")
manifest = json.loads((root / "manifest.json").read_text())
for name, source in manifest["sources"].items():
    for split in ("train", "heldout"):
        entry = source[split]
        assert hashlib.sha256((root / entry["file"]).read_bytes()).hexdigest() == entry["sha256"], entry["file"]
print("corpus:", manifest["total"])
EOF
}

corpus_args() {
    echo --corpus $CORPUS/train/*.txt --heldout $CORPUS/heldout/*.txt
}

sweep() {
    setup
    local configs=$CONFIGS steps=$SWEEP_STEPS
    if [ "$SWEEP" = 0 ]; then configs=elmo-small; steps=50; fi
    # shellcheck disable=SC2046
    $PY -m training.sweep $(corpus_args) --configs $configs --steps "$steps" --max-minutes "$SWEEP_MINUTES" \
        --device cuda --precision "$PRECISION" --budget-minutes "$TRAIN_MINUTES" --out "$RUN/sweep" \
        2>&1 | tee "$OUT/sweep.log" | grep -v 'batch/s'
    cp "$RUN/sweep/sweep.json" "$OUT/"
}

train() {
    setup
    local best epochs
    # The sweep's results and the checkpoint live on the machine, which goes back after 30 s idle with them.
    [ -f "$RUN/sweep/sweep.json" ] || die "no sweep on this machine ($RUN/sweep/sweep.json): it was released since \
(and its checkpoint with it); run '$0 sweep' again"
    best=$($PY -c "import json; print(json.load(open('$RUN/sweep/sweep.json'))['best'])")
    epochs=$($PY -c "import json; print(json.load(open('$RUN/sweep/sweep.json'))['epochs_in_budget'])")
    log "continuing $best for $epochs epochs in all, $TRAIN_CALL_MINUTES minutes in this call"
    # shellcheck disable=SC2046
    $PY -c "import sys; from training.cli import train_main; sys.exit(train_main())" $(corpus_args) \
        --out "$RUN/sweep/$best" --config "$best" --device cuda --precision "$PRECISION" --epochs "$epochs" \
        --max-minutes "$TRAIN_CALL_MINUTES" 2>&1 | tee "$OUT/train-$(date +%s).log" | grep -v 'batch/s' | tail -40
    if [ -f "$RUN/sweep/$best/train_log.json" ]; then
        pack "$RUN/sweep/$best"
        log "finished: the model is in \$OUT (run scripts/gpu-train.sh fetch FILES_AT here)"
    else
        log "not finished yet: run scripts/gpu-train.sh train again"
    fi
}

pack() {  # the output folder into $OUT: weights.hdf5 in parts under 16 MiB, the rest in one tar, and checksums
    local dir=$1
    split -b 15000000 -d "$dir/weights.hdf5" "$OUT/weights.hdf5.part"
    tar -C "$dir" -czf "$OUT/model-files.tar.gz" options.json vocab.txt softmax.hdf5 train_log.json MODEL_CARD.md \
        $(cd "$dir" && ls training_curve.png 2>/dev/null)
    cp "$RUN/sweep/sweep.json" "$OUT/" 2>/dev/null || true
    (cd "$dir" && sha256sum weights.hdf5 options.json) > "$OUT/SHA256SUMS"
    ls -la "$OUT"
}

fetch() {  # here, not on the GPU machine
    local from=${1:?usage: scripts/gpu-train.sh fetch FILES_AT}
    local to=build/gpu-model
    mkdir -p "$to"
    cat "$from"/weights.hdf5.part* > "$to/weights.hdf5"
    tar -C "$to" -xzf "$from/model-files.tar.gz"
    cp "$from"/sweep.json "$to/" 2>/dev/null || true
    (cd "$to" && sha256sum -c "$from/SHA256SUMS")
    .venv/bin/python -c "import json, pathlib; from training.trainer import plot_curve; \
plot_curve(json.load(open('$to/train_log.json'))['history'], pathlib.Path('$to/training_curve.png'))"
    .venv/bin/elmo-export --options "$to/options.json" --weights "$to/weights.hdf5" --out build/models/gpu-model
    [ -f build/corpus/examples.jsonl ] || .venv/bin/python -m training.corpus --out build/corpus
    .venv/bin/python -m training.probes.senses --model build/models/gpu-model --examples build/corpus/examples.jsonl
    .venv/bin/python -m training.probes.syntax --model build/models/gpu-model --examples build/corpus/examples.jsonl
    # the control: the same architecture with random weights
    .venv/bin/python -c "from model_export.options import load_options; \
from model_export.weights import random_bilm, write_published_weights; \
write_published_weights(random_bilm(load_options('$to/options.json'), seed=0), '$to/random-weights.hdf5')"
    .venv/bin/elmo-export --options "$to/options.json" --weights "$to/random-weights.hdf5" \
        --out build/models/gpu-model-random
    .venv/bin/python -m training.probes.senses --model build/models/gpu-model-random --examples build/corpus/examples.jsonl
    .venv/bin/python -m training.probes.syntax --model build/models/gpu-model-random --examples build/corpus/examples.jsonl
}

case "${1:-}" in
    sweep) sweep ;;
    train) train ;;
    fetch) shift; fetch "$@" ;;
    *) echo "usage: scripts/gpu-train.sh sweep|train|fetch FILES_AT" >&2; exit 2 ;;
esac
