#!/usr/bin/env bash
# The pipeline demo (SFT -> reward model -> RL on the tiny model): install what is missing, then run it.
#   bash tools/demo_pipeline.sh [RUN_DIR] [--slurm]      (default runs/demo-pipeline; --slurm: on the local
#                                                         cluster, brought up first with bash slurm/up.sh 4)
set -euo pipefail
args=()
for arg in "$@"; do  # (a RUN_DIR given is the caller's folder's, not the repository's)
    case "$arg" in -*|/*) args+=("$arg") ;; *) args+=("$PWD/$arg") ;; esac
done
cd "$(dirname "$0")/.."
bash tools/setup.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
exec .venv/bin/python tools/demo_pipeline.py ${args[@]+"${args[@]}"}
