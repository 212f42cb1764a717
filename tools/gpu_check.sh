#!/usr/bin/env bash
# The GPU checks in one command, on a machine with one NVIDIA GPU and slurm-rlhf's Python packages:
#
#   bash tools/gpu_check.sh [OUT_DIR]
#
# 1. the `gpu` tests (tests/gpu): bf16 training with the memory switches, the trainer's state leaving the
#    GPU between updates, weight sync between two processes on the one GPU, a GRPO run in Flattening;
# 2. tools/bench_sync.py --device cuda: weight sync on the one GPU against a raw broadcast of the same bytes;
# 3. tools/bench_memory.py on Qwen2.5-0.5B's config (random weights), bf16: peak GPU memory and MFU of
#    each memory switch.
# Each part has a time limit of its own and the next runs whatever it gave; tables and logs go to OUT_DIR.
set -u
out=${1:-${OUT:-/tmp/gpu-check}}
mkdir -p "$out" && out=$(cd "$out" && pwd)  # (absolute: the script works from the repository's root)
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-/tmp/torch_extensions}  # (DeepSpeed's CPU Adam, built once)
quiet() { grep -v -E "^\[[0-9-]+ [0-9:,]+\] \[(WARNING|INFO)\]|Warning|warnings.warn|return func"; }

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import sys, torch, transformers, peft, deepspeed; print('python', sys.version.split()[0], 'torch',
torch.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__, 'deepspeed', deepspeed.__version__)"

echo "== 1. pytest -m gpu tests/gpu"
started=$SECONDS
timeout 270 python3 -m pytest -m gpu tests/gpu -q -s -p no:cacheprovider > "$out/pytest.log" 2>&1
echo "rc=$? in $((SECONDS - started)) s"
quiet < "$out/pytest.log" | tail -40

echo "== 2. tools/bench_sync.py --device cuda"
started=$SECONDS
timeout 75 python3 tools/bench_sync.py --device cuda --repeats 5 > "$out/sync.log" 2>&1
echo "rc=$? in $((SECONDS - started)) s"
quiet < "$out/sync.log" | tail -12

echo "== 3. tools/bench_memory.py --config Qwen2.5-0.5B"
started=$SECONDS
timeout 220 python3 tools/bench_memory.py --config tests/fixtures/model_configs/Qwen--Qwen2.5-0.5B.json \
    --batch 8 --seq 1024 --steps 4 --threads 8 --json "$out/memory.json" > "$out/memory.log" 2>&1
echo "rc=$? in $((SECONDS - started)) s"
quiet < "$out/memory.log" | tail -14
