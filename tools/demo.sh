#!/usr/bin/env bash
# The demo: install what is missing, build the tiny model set offline, run tiny GRPO into RUN_DIR.
#   bash tools/demo.sh [RUN_DIR]      (default runs/demo)
set -euo pipefail
case "${1:-}" in
    -h|--help) sed -n '2,3s/^# \{0,1\}//p' "$0"; exit 0 ;;
    -*) echo "demo.sh: unknown option $1 (usage: bash tools/demo.sh [RUN_DIR])" >&2; exit 2 ;;
esac
RUN_DIR=${1:-}
case "$RUN_DIR" in ""|/*) ;; *) RUN_DIR="$PWD/$RUN_DIR" ;; esac  # (a RUN_DIR given is the caller's folder's)
cd "$(dirname "$0")/.."
RUN_DIR=${RUN_DIR:-runs/demo}
bash tools/setup.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
.venv/bin/slurm-rlhf tiny models/tiny
# A previous demo run in the same directory is replaced; any other run there is left alone.
if [ -f "$RUN_DIR/config.yaml" ] && grep -q '^  name: tiny-grpo$' "$RUN_DIR/config.yaml"; then
    echo "demo: replacing the previous demo run in $RUN_DIR"
    rm -rf -- "$RUN_DIR"
fi
exec .venv/bin/slurm-rlhf run templates/examples/tiny-grpo.yaml --run-dir "$RUN_DIR"
