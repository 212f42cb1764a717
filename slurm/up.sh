#!/usr/bin/env bash
# Bring up a real Slurm cluster of N virtual nodes (n1..nN) on this machine, from nothing.
#
#   bash slurm/up.sh [N] [--accounting]     (default N=4; run as root)
#
# Installs the Debian packages if missing (munge, slurmctld, slurmd, slurm-client; with --accounting
# also slurmdbd and MariaDB, for `sacct`), writes /etc/slurm/slurm.conf (marked as ours; a foreign one
# is never overwritten), starts munged, slurmctld and one slurmd per node, and waits until every node
# is idle. Idempotent: a running cluster of the same size is left as it is. `bash slurm/down.sh` stops
# every daemon this script started.
set -euo pipefail
N=4
ACCOUNTING=0
for arg in "$@"; do
    case "$arg" in
        --accounting) ACCOUNTING=1 ;;
        ''|*[!0-9]*) echo "usage: bash slurm/up.sh [N] [--accounting]" >&2; exit 2 ;;
        *) N=$arg ;;
    esac
done
[ "$N" -ge 1 ] && [ "$N" -le 64 ] || { echo "up.sh: N must be 1..64" >&2; exit 2; }
[ "$(id -u)" = 0 ] || { echo "up.sh: run as root (it installs packages and starts daemons)" >&2; exit 1; }

MARK="# slurm-rlhf local test cluster"
CONF=/etc/slurm/slurm.conf
STATE=/var/spool/slurm-rlhf
LOGS=/var/log/slurm-rlhf
RUN=/run/slurm-rlhf
PORT0=17000

pkgs=()
command -v munged >/dev/null || pkgs+=(munge)
command -v slurmctld >/dev/null || pkgs+=(slurmctld)
command -v slurmd >/dev/null || pkgs+=(slurmd)
command -v sbatch >/dev/null || pkgs+=(slurm-client)
if [ "$ACCOUNTING" = 1 ]; then
    command -v slurmdbd >/dev/null || pkgs+=(slurmdbd)
    command -v mariadbd >/dev/null || pkgs+=(mariadb-server)
fi
if [ ${#pkgs[@]} -gt 0 ]; then
    echo "up.sh: installing ${pkgs[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${pkgs[@]}" >/dev/null
fi

if [ -f "$CONF" ] && ! grep -qF "$MARK" "$CONF"; then
    echo "up.sh: $CONF exists and was not written by this script; not touching it" >&2
    exit 1
fi

alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

# Already up with N nodes (and accounting if asked)? Then there is nothing to do.
if alive "$RUN/slurmctld.pid" && [ -f "$RUN/nodes" ] && [ "$(cat "$RUN/nodes")" = "$N $ACCOUNTING" ]; then
    up=1
    for i in $(seq 1 "$N"); do alive "$RUN/slurmd-n$i.pid" || up=0; done
    if [ "$up" = 1 ]; then
        echo "up.sh: cluster of $N nodes already up"
        exit 0
    fi
fi
if alive "$RUN/slurmctld.pid" || ls "$RUN"/slurmd-*.pid >/dev/null 2>&1; then
    bash "$(dirname "$0")/down.sh"
fi

mkdir -p "$STATE" "$LOGS" "$RUN" /run/munge
chown munge: /run/munge
if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
    [ -f /etc/munge/munge.key ] || { mungekey -c 2>/dev/null || create-munge-key -f; chown munge: /etc/munge/munge.key; }
    runuser -u munge -- munged --pid-file=/run/munge/munged.pid
    echo /run/munge/munged.pid > "$RUN/munged.started"
    for _ in $(seq 1 50); do munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && break; sleep 0.1; done
fi

# Virtual node names resolve to this machine.
for i in $(seq 1 "$N"); do
    grep -qE "^127\.0\.0\.1\s+n$i(\s|$)" /etc/hosts || echo "127.0.0.1 n$i $MARK" >> /etc/hosts
done

CPUS=4
MEM=4000
# Memory is counted as most clusters count it (CR_CPU_Memory; a job gets DefMemPerCPU per CPU unless it asks),
# so that job steps sharing a node must each ask for their share (a step that asks for none takes all the
# job's memory per node there, and the next step waits for it).
cat > "$CONF" <<EOF
$MARK (written by slurm/up.sh; bash slurm/down.sh stops it)
ClusterName=rlhf
SlurmctldHost=localhost(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=cred_expire=10
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU_Memory
DefMemPerCPU=$((MEM / CPUS))
SlurmdParameters=config_overrides
CommunicationParameters=NoInAddrAny
ReturnToService=2
KillWait=5
MinJobAge=600
SchedulerParameters=bf_interval=1,sched_interval=2
FirstJobId=$(( $(date +%s) % 50000000 + 1000 ))
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/d-%n
SlurmctldPidFile=$RUN/slurmctld.pid
SlurmdPidFile=$RUN/slurmd-%n.pid
SlurmctldLogFile=$LOGS/slurmctld.log
SlurmdLogFile=$LOGS/slurmd-%n.log
SlurmctldPort=6817
JobCompType=jobcomp/filetxt
JobCompLoc=$LOGS/jobcomp.txt
EOF
if [ "$ACCOUNTING" = 1 ]; then
    cat >> "$CONF" <<EOF
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
JobAcctGatherType=jobacct_gather/linux
EOF
fi
cat >> "$CONF" <<EOF
NodeName=n[1-$N] NodeHostname=localhost NodeAddr=127.0.0.1 Port=[$((PORT0 + 1))-$((PORT0 + N))] CPUs=$CPUS RealMemory=$MEM State=UNKNOWN
PartitionName=debug Nodes=n[1-$N] Default=YES MaxTime=INFINITE State=UP
EOF
# Two more partitions over halves of the nodes, for heterogeneous jobs (e.g. generators apart from trainers).
if [ "$N" -ge 2 ]; then
    half=$(( N / 2 ))
    cat >> "$CONF" <<EOF
PartitionName=front Nodes=n[1-$half] MaxTime=INFINITE State=UP
PartitionName=back Nodes=n[$((half + 1))-$N] MaxTime=INFINITE State=UP
EOF
fi
rm -rf "$STATE/ctld"
mkdir -p "$STATE/ctld"

if [ "$ACCOUNTING" = 1 ]; then
    mkdir -p /run/mysqld && chown mysql: /run/mysqld
    if ! mysqladmin ping >/dev/null 2>&1; then
        runuser -u mysql -- mariadbd --pid-file=/run/mysqld/mysqld.pid >"$LOGS/mariadb.log" 2>&1 &
        echo /run/mysqld/mysqld.pid > "$RUN/mariadb.started"
        for _ in $(seq 1 100); do mysqladmin ping >/dev/null 2>&1 && break; sleep 0.1; done
    fi
    mysql -e "CREATE DATABASE IF NOT EXISTS slurm_acct_db; CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY 'slurm'; GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost';"
    install -m 600 /dev/stdin /etc/slurm/slurmdbd.conf <<EOF
$MARK
AuthType=auth/munge
DbdHost=localhost
SlurmUser=root
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageUser=slurm
StoragePass=slurm
StorageLoc=slurm_acct_db
PidFile=$RUN/slurmdbd.pid
LogFile=$LOGS/slurmdbd.log
EOF
    slurmdbd
    for _ in $(seq 1 100); do sacctmgr -n list cluster >/dev/null 2>&1 && break; sleep 0.1; done
    sacctmgr -i add cluster rlhf >/dev/null 2>&1 || true
fi

slurmctld
for i in $(seq 1 "$N"); do
    mkdir -p "$STATE/d-n$i"
    slurmd -N "n$i"
done
echo "$N $ACCOUNTING" > "$RUN/nodes"

for _ in $(seq 1 300); do
    idle=$(sinfo -h -p debug -t idle -o '%D' 2>/dev/null | head -n1)
    [ "${idle:-0}" = "$N" ] && break
    sleep 0.1
done
if [ "${idle:-0}" != "$N" ]; then
    echo "up.sh: only ${idle:-0} of $N nodes are idle after 30 s; see $LOGS" >&2
    sinfo >&2 || true
    exit 1
fi
echo "up.sh: Slurm cluster of $N nodes (n1..n$N) is up; partitions: $(sinfo -h -o '%P' | tr '\n' ' ')"
