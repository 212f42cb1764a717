"""Slurm launcher: inside an allocation, one `srun` job step per node group, each on its own nodes (or on
the nodes of the group it names in `same_nodes_as`, taking only the CPUs and GPUs it asks for).

The workers are the same `python -m toolkit.worker` as locally, with the same environment contract;
their rank is the task's SLURM_PROCID and they bind to their node's address. A group's step runs on
its disjoint slice of the allocation's nodes (`--nodelist`), or in its own component of a heterogeneous
job (`--het-group`). srun's own report (which task failed, on which node, the step id) is kept in
RUN_DIR/logs/srun-<group>.log and named in errors.
"""

from __future__ import annotations

import datetime
import logging
import os
import re
import signal
import subprocess
import sys

from toolkit.launch import env as E
from toolkit.launch.allocation import Allocation, assign_nodes, mem_option, shares_nodes, step_mem_mb
from toolkit.launch.exits import Exit, wait_all
from toolkit.launch.rundir import RunDir
from toolkit.placement.plan import WorkerGroup

TASK_FAILED = re.compile(r"srun: error: (?P<node>\S+): tasks? (?P<tasks>[\d,-]+): (?P<what>.+)")
STEP_ID = re.compile(r"StepId=(?P<step>\d+\.\d+)")
# How long the driver asks Slurm for the job's end before it stops as if the end were now (the driver
# waits for it between steps).
END_TIME_TIMEOUT_S = 10.0
SCANCEL_TIMEOUT_S = 30.0

log = logging.getLogger(__name__)


def hostnames(nodelist: str) -> list[str]:
    """A Slurm node list (`n[1-3],x`) expanded by scontrol."""
    out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=30,
                         check=True)
    return out.stdout.split()


def component_nodes(allocation: Allocation, environ=os.environ) -> list[list[str]]:
    """The nodes of each job component, from the variables Slurm sets in the batch script."""
    if allocation.heterogeneous:
        return [hostnames(environ[f"SLURM_JOB_NODELIST_HET_GROUP_{i}"]) for i in range(len(allocation.components))]
    return [hostnames(environ["SLURM_JOB_NODELIST"])]


def srun_command(group: WorkerGroup, nodes: list[str], het_group: int | None, python: str, log_dir: str,
                 shared: bool = False, mem_mb: int | None = None) -> list[str]:
    """The job step of `group` on `nodes`. `shared`: another group's step runs on these nodes too, so this
    step takes only the CPUs, GPUs and memory it asks for (--exact; by default a step takes every CPU of
    its nodes and the next one waits for them): its `mem_gb`, else `mem_mb` (its share, `step_mem_mb`).
    `--export=ALL`: the workers get the environment the driver gives srun (placement's env, PATH, HOME, the
    run's variables) even where the job was submitted with `--export=NONE` (sbatch or `slurm.sbatch: {export:
    NONE}`), which srun otherwise inherits (SLURM_EXPORT_ENV) and starts the workers with almost nothing."""
    cmd = ["srun", "--verbose", f"--job-name={group.name}", f"--nodes={group.nodes}", f"--ntasks={group.workers}",
           f"--ntasks-per-node={group.tasks_per_node}", f"--nodelist={','.join(nodes)}", "--export=ALL",
           "--kill-on-bad-exit=1", "--unbuffered", f"--output={log_dir}/{group.name}-%t.log"]
    if het_group is not None:
        cmd.insert(1, f"--het-group={het_group}")
    if group.cpus_per_worker:
        cmd.append(f"--cpus-per-task={group.cpus_per_worker}")
    if group.gpus_per_worker:
        cmd.append(f"--gpus-per-task={group.gpus_per_worker}")
    if shared:
        cmd.append("--exact")
        if group.mem_gb:
            cmd.append(f"--mem={mem_option(group.mem_gb)}")
        elif mem_mb:
            cmd.append(f"--mem={mem_mb}M")
    return [*cmd, python, "-m", "toolkit.worker"]


class SlurmLauncher:
    name = "slurm"

    def __init__(self, run_dir: RunDir, allocation: Allocation, python: str = sys.executable,
                 bind_host: str | None = None):
        self.run_dir, self.allocation, self.python, self.bind_host = run_dir, allocation, python, bind_host
        self.job_id = os.environ["SLURM_JOB_ID"]
        self.nodes = assign_nodes(allocation, component_nodes(allocation))
        self.steps: dict[str, subprocess.Popen] = {}
        self.groups: dict[str, WorkerGroup] = {}
        self.env: dict[str, str] = {}  # the run's environment for the workers, to start a step again
        self._reported: set[str] = set()
        self._log_from: dict[str, int] = {}  # where this launcher's part of each srun log starts

    def srun_log(self, group: str):
        return self.run_dir.logs / f"srun-{group}.log"

    def start(self, groups: list[WorkerGroup], env: dict[str, str]) -> None:
        self.env = env
        for group in groups:
            self._start_step(group, env)

    def _start_step(self, group: WorkerGroup, env: dict[str, str]) -> None:
        het = self.allocation.component_of(group) if self.allocation.heterogeneous else None
        everyone = [g for c in self.allocation.components for g in c.groups]
        job_mem = os.environ.get("SLURM_MEM_PER_NODE" if het is None else f"SLURM_MEM_PER_NODE_HET_GROUP_{het}")
        cmd = srun_command(group, self.nodes[group.name], het, self.python, str(self.run_dir.logs),
                           shares_nodes(group, everyone),
                           step_mem_mb(group, everyone, int(job_mem) if job_mem and job_mem.isdigit() else None))
        child_env = {**os.environ, **env, **group.env, E.GROUP: group.name}
        child_env.pop(E.RANK, None)  # each task's rank is its SLURM_PROCID
        if self.bind_host:  # (transport.bind_host: each worker resolves it on its own node)
            child_env[E.BIND_HOST] = self.bind_host
        with open(self.srun_log(group.name), "ab") as log:  # (a step started again appends to it)
            self._log_from[group.name] = log.tell()
            log.write(f"$ {' '.join(cmd)}\n".encode())
            log.flush()
            self.steps[group.name] = subprocess.Popen(cmd, env=child_env, stdin=subprocess.DEVNULL, stdout=log,
                                                      stderr=subprocess.STDOUT, start_new_session=True)
        self.groups[group.name] = group

    def restarts_with(self, worker_id: str) -> list[str]:
        """The workers started again when `worker_id` is: every task of its step. A step's tasks end together
        (--kill-on-bad-exit ends the others when one dies), and Slurm adds no task to a running step."""
        return self.groups[worker_id.split(":")[0]].worker_ids()

    def restart(self, worker_id: str, env: dict[str, str]) -> None:
        """Start the step of worker `worker_id` again, every task of it (`restarts_with`; with `env` added),
        as a new step on the same nodes, after ending what is left of it (a hung worker: scancel -s KILL).
        Each task gets the rank it had, on the node it had (the same node list and task layout)."""
        name = worker_id.split(":")[0]
        old, step = self.steps[name], self.step_id(name)
        if old.poll() is None and step:
            _kill_step(step)
        if not wait_all([old], 30):
            _signal(old, signal.SIGKILL)
            wait_all([old], 10)
        self._reported.discard(name)
        self._start_step(self.groups[name], {**self.env, **env})  # (`env` for this step only)

    def step_id(self, group: str) -> str | None:
        """`<job>.<step>` of a group's step, as srun reported it."""
        match = STEP_ID.search(self._srun_text(group))
        return match["step"] if match else None

    def end_time(self) -> float | None:
        """When Slurm will end the job (unix time), or None if it has no limit or cannot say (within
        END_TIME_TIMEOUT_S: the driver then stops as if the end were now, the safe side)."""
        try:
            out = subprocess.run(["squeue", "-h", "-j", self.job_id, "-o", "%e"], capture_output=True, text=True,
                                 timeout=END_TIME_TIMEOUT_S,  # (in the format parsed below, whatever the user's)
                                 env={**os.environ, "SLURM_TIME_FORMAT": "standard"})
        except (subprocess.TimeoutExpired, OSError):
            return None
        try:
            return datetime.datetime.strptime(out.stdout.split()[0], "%Y-%m-%dT%H:%M:%S").timestamp()
        except (IndexError, ValueError):
            return None

    def describe(self, worker_id: str) -> str:
        group = worker_id.split(":")[0]
        step = self.step_id(group)
        return f"Slurm step {step or '(not started)'} on nodes {','.join(self.nodes.get(group, []))}"

    def poll(self) -> list[Exit]:
        """Steps that ended since the last call, each blamed on the task srun reports first."""
        exited = []
        for name, proc in self.steps.items():
            if name in self._reported or proc.poll() is None:
                continue
            self._reported.add(name)
            text = self._srun_text(name)
            rank, detail = 0, f"srun step {self.step_id(name) or '?'} ended"
            said = [line.strip() for line in text.splitlines() if line.startswith("srun: error:")][-3:]
            if said:  # (srun failed before any task ran, say: no worker log names why, srun's does)
                detail += f": {' / '.join(said)} (srun's log: {self.srun_log(name)})"
            failure = TASK_FAILED.search(text)
            if failure:
                rank = int(re.split(r"[,-]", failure["tasks"])[0])
                detail = f"srun: step {self.step_id(name) or '?'}, node {failure['node']}: {failure['what'].strip()}"
            code = proc.returncode
            exited.append(Exit(f"{name}:{rank}", code if code or not failure else 1, detail))
        return exited

    def wait(self, timeout_s: float, leaving_out: list[str] = ()) -> bool:
        """Wait until every step (but those of workers `leaving_out`) has ended; True if they all did in time."""
        skipped = {w.split(":")[0] for w in leaving_out}
        return wait_all([p for name, p in self.steps.items() if name not in skipped], timeout_s)

    def stop(self, grace_s: float = 5.0) -> None:
        """End every step: SIGTERM through srun (it signals the tasks), then scancel -s KILL what is left."""
        running = {n: p for n, p in self.steps.items() if p.poll() is None}
        for proc in running.values():
            _signal(proc, signal.SIGTERM)
        if self.wait(grace_s):
            return
        for name, proc in running.items():
            step = self.step_id(name)
            if proc.poll() is None and step:
                _kill_step(step)
        if not self.wait(30):
            for proc in self.steps.values():
                _signal(proc, signal.SIGKILL)
            self.wait(10)

    def _srun_text(self, group: str) -> str:
        """What srun wrote for this launcher's step of `group`."""
        try:
            with open(self.srun_log(group), "rb") as f:
                f.seek(self._log_from.get(group, 0))
                return f.read().decode(errors="replace")
        except OSError:
            return ""


def _kill_step(step: str) -> None:
    """scancel -s KILL of a job step, within SCANCEL_TIMEOUT_S: a controller that does not answer in time
    is logged, not raised (whoever called goes on to kill the step's srun)."""
    try:
        subprocess.run(["scancel", "--signal=KILL", step], capture_output=True, timeout=SCANCEL_TIMEOUT_S)
    except (subprocess.TimeoutExpired, OSError) as e:
        log.warning("scancel --signal=KILL %s: %s; killing its srun instead", step, e)


def _signal(proc: subprocess.Popen, sig: int) -> None:
    try:
        proc.send_signal(sig)
    except ProcessLookupError:
        pass
