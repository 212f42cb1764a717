#!/usr/bin/env bash
# Stop the local Slurm cluster that slurm/up.sh started: cancel its jobs, then stop every daemon it
# started (by pid file: slurmd per node, slurmctld, slurmdbd, and munged/MariaDB if up.sh started them).
#
#   bash slurm/down.sh
set -uo pipefail
[ "$(id -u)" = 0 ] || { echo "down.sh: run as root" >&2; exit 1; }
RUN=/run/slurm-rlhf

alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

stop() {  # stop the daemon whose pid is in file $1: TERM, up to 10 s, then KILL
    local file=$1 pid
    [ -f "$file" ] || return 0
    pid=$(cat "$file")
    if kill -0 "$pid" 2>/dev/null; then
        kill "$pid" 2>/dev/null
        for _ in $(seq 1 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
        kill -9 "$pid" 2>/dev/null || true
    fi
    rm -f "$file"
}

stepds() {  # pids of slurmstepd processes (job step daemons of this machine's cluster)
    local p
    for p in /proc/[0-9]*; do
        [ "$(cat "$p/comm" 2>/dev/null)" = slurmstepd ] && echo "${p#/proc/}"
    done
}

if alive "$RUN/slurmctld.pid"; then
    jobs=$(squeue -h -o '%A' 2>/dev/null | sort -u)
    if [ -n "$jobs" ]; then
        echo "down.sh: cancelling jobs $(echo $jobs)"
        scancel $jobs 2>/dev/null || true
        for _ in $(seq 1 150); do [ -z "$(squeue -h -o '%A' 2>/dev/null)" ] && break; sleep 0.1; done
    fi
fi
# Job steps end with their jobs; give their step daemons a moment, then end what is left.
for _ in $(seq 1 100); do [ -z "$(stepds)" ] && break; sleep 0.1; done
for pid in $(stepds); do kill -9 "$pid" 2>/dev/null; done

for file in "$RUN"/slurmd-*.pid; do stop "$file"; done
stop "$RUN/slurmctld.pid"
stop "$RUN/slurmdbd.pid"
if [ -f "$RUN/mariadb.started" ]; then
    stop "$(cat "$RUN/mariadb.started")"
    rm -f "$RUN/mariadb.started"
fi
if [ -f "$RUN/munged.started" ]; then
    stop "$(cat "$RUN/munged.started")"
    rm -f "$RUN/munged.started"
fi
rm -f "$RUN/nodes"
echo "down.sh: local Slurm cluster stopped"
