#!/usr/bin/env bash
# The GPU checks in one command, on a machine with one NVIDIA GPU and slurm-rlhf's Python packages:
#
#   bash tools/gpu_check.sh [OUT_DIR]              (PARTS="tests fp16" bash tools/gpu_check.sh: some parts)
#
# tests  the `gpu` tests (tests/gpu): bf16 and fp16 training with the memory switches, the trainer's state
#        leaving the GPU between updates, weight sync between two processes on the one GPU, a GRPO run in
#        Flattening;
# sync   tools/bench_sync.py --device cuda: weight sync on the one GPU against a raw broadcast of the same bytes;
# bf16   tools/bench_memory.py on Qwen2.5-0.5B's config (random weights), bf16: peak GPU memory and MFU of
#        each memory switch;
# fp16   the same in fp16 (DeepSpeed's dynamic loss scaling), the switches that fp16 changes.
# Each part has a time limit of its own and the next runs whatever it gave; tables and logs go to OUT_DIR.
# All four: about 11 minutes on an H200 (their times in two sessions added up), the CPU Adam build included;
# a 15-minute lease, the machine's start included, fits two or three of them.
set -u
parts=" ${PARTS:-tests sync bf16 fp16} "
out=${1:-${OUT:-/tmp/gpu-check}}
mkdir -p "$out" && out=$(cd "$out" && pwd)  # (absolute: the script works from the repository's root)
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-/tmp/torch_extensions}  # (DeepSpeed's CPU Adam, built once)
quiet() { grep -v -E "^\[[0-9-]+ [0-9:,]+\] \[(WARNING|INFO)\]|Warning|warnings.warn|return func"; }

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import sys, torch, transformers, peft, deepspeed; print('python', sys.version.split()[0], 'torch',
torch.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__, 'deepspeed', deepspeed.__version__)"

qwen=tests/fixtures/model_configs/Qwen--Qwen2.5-0.5B.json

if [[ $parts == *" tests "* ]]; then
    echo "== tests: pytest -m gpu tests/gpu"
    started=$SECONDS
    timeout 330 python3 -m pytest -m gpu tests/gpu -q -s -p no:cacheprovider > "$out/pytest.log" 2>&1
    echo "rc=$? in $((SECONDS - started)) s"
    quiet < "$out/pytest.log" | tail -40
fi
if [[ $parts == *" sync "* ]]; then
    echo "== sync: tools/bench_sync.py --device cuda"
    started=$SECONDS
    timeout 75 python3 tools/bench_sync.py --device cuda --repeats 5 > "$out/sync.log" 2>&1
    echo "rc=$? in $((SECONDS - started)) s"
    quiet < "$out/sync.log" | tail -12
fi
if [[ $parts == *" bf16 "* ]]; then
    echo "== bf16: tools/bench_memory.py --config Qwen2.5-0.5B"
    started=$SECONDS
    timeout 220 python3 tools/bench_memory.py --config $qwen --batch 8 --seq 1024 --steps 4 --threads 8 \
        --json "$out/memory.json" > "$out/memory.log" 2>&1
    echo "rc=$? in $((SECONDS - started)) s"
    quiet < "$out/memory.log" | tail -14
fi
if [[ $parts == *" fp16 "* ]]; then
    echo "== fp16: tools/bench_memory.py --config Qwen2.5-0.5B --dtype float16"
    started=$SECONDS
    timeout 150 python3 tools/bench_memory.py --config $qwen --batch 8 --seq 1024 --steps 4 --threads 8 \
        --dtype float16 --settings baseline,checkpointing,offload_optimizer,lora --json "$out/fp16.json" \
        > "$out/fp16.log" 2>&1
    echo "rc=$? in $((SECONDS - started)) s"
    quiet < "$out/fp16.log" | tail -10
fi
