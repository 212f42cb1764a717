#!/usr/bin/env bash
# The GPU checks in one command, on a machine with one NVIDIA GPU and slurm-rlhf's Python packages:
#
#   bash tools/gpu_check.sh [OUT_DIR]              (PARTS="tests fp16" bash tools/gpu_check.sh: some parts)
#
# tests  the `gpu` tests (tests/gpu): bf16 and fp16 training with the memory switches, the trainer's state
#        leaving the GPU between updates, weight sync between two processes on the one GPU, an NCCL group
#        over the run's own rendezvous store, a GRPO run in Flattening;
# sync   tools/bench_sync.py --device cuda: weight sync on the one GPU against a raw broadcast of the same bytes;
# bf16   tools/bench_memory.py on Qwen2.5-0.5B's config (random weights), bf16: peak GPU memory and MFU of
#        each memory switch;
# fp16   the same in fp16 (DeepSpeed's dynamic loss scaling), the switches that fp16 changes.
# Each part has a time limit of its own and the next runs whatever it gave; tables and logs go to OUT_DIR.
# On a fresh H200 (2026-12-04), the CPU Adam build included: tests about 7 minutes (five of the six in
# 330 s, then the Flattening run alone in 80 s), sync about 1. The four parts' limits add up to 925 s,
# more than a 15-minute lease leaves after the machine's start: take `tests sync` in one call, the tables
# (bf16 fp16) in another.
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
memory="tools/bench_memory.py --config $qwen --batch 8 --seq 1024 --steps 4 --threads 8"

# part NAME SECONDS LOG LINES COMMAND...: COMMAND, if NAME is one of the parts, within SECONDS; its output
# goes to OUT_DIR/LOG and its last LINES lines are shown
part() {
    local name=$1 limit=$2 log=$3 lines=$4
    shift 4
    [[ $parts == *" $name "* ]] || return 0
    echo "== $name: $*"
    local started=$SECONDS
    timeout "$limit" "$@" > "$out/$log" 2>&1
    echo "rc=$? in $((SECONDS - started)) s"
    quiet < "$out/$log" | tail -"$lines"
}

part tests 480 pytest.log 40 python3 -m pytest -m gpu tests/gpu -q -s -p no:cacheprovider
part sync 75 sync.log 12 python3 tools/bench_sync.py --device cuda --repeats 5
part bf16 220 memory.log 14 python3 $memory --json "$out/memory.json"
part fp16 150 fp16.log 10 python3 $memory --dtype float16 --settings baseline,checkpointing,offload_optimizer,lora \
    --json "$out/fp16.json"
