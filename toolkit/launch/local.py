"""Local launcher: every worker is a process on this machine, in a session of its own.

The embedded default: a laptop or CI runs a whole RL job with no Slurm. Workers get the same
environment contract as under Slurm. Each worker leads its own process group, so stopping a worker
also stops whatever it started (vLLM engine processes, compile workers); workers also receive SIGTERM
if the driver dies (PR_SET_PDEATHSIG), so none outlives its run. With more workers than cores (and no
GPUs), workers are forks of a process that has imported torch and transformers once for all of them
(forkserver.py).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from toolkit.errors import RunError
from toolkit.launch import env as E
from toolkit.launch.exits import Exit, wait_all
from toolkit.launch.forkserver import ForkServer, Forked, die_with_parent, usable
from toolkit.launch.rundir import RunDir
from toolkit.placement.plan import WorkerGroup
from toolkit.tmpdir import remove_left


def machine_gpus() -> int:
    """The GPUs of this machine, as torch counts them for the workers (in a process of its own: the driver does
    not import torch)."""
    probe = [sys.executable, "-c", "import torch; print(torch.cuda.device_count())"]
    try:
        out = subprocess.run(probe, capture_output=True, text=True, timeout=300)
        return int(out.stdout.split()[-1])
    except (subprocess.TimeoutExpired, OSError) as e:
        raise RunError(f"could not count this machine's GPUs with torch: {e}") from None
    except (ValueError, IndexError):
        raise RunError(f"could not count this machine's GPUs with torch: {out.stderr.strip()[-300:]}") from None


def visible_gpus(environ, wanted: int, asked: str = "gpus_per_worker") -> list[str]:
    """The `wanted` GPUs to hand out to the workers, in order: among those CUDA_VISIBLE_DEVICES gives the
    driver where it is set (`2,3`: GPUs 2 and 3, not 0 and 1, which may be someone else's), else 0, 1, ...
    of the machine's (a config planned for a GPU cluster, run on a machine without them, started its
    workers on CPUs with the GPUs' settings: 8 vLLM engines of 33.5 GB of KV cache each). `asked`: the
    settings that ask for them, for the error."""
    if "CUDA_VISIBLE_DEVICES" not in environ:
        if wanted and wanted > (count := machine_gpus()):
            raise RunError(f"the run's workers take {wanted} GPUs ({asked}), and this machine has {count}; "
                           "run it where there are that many (slurm-rlhf submit), or give it fewer workers or "
                           "gpus_per_worker (0: on CPUs)")
        return [str(i) for i in range(wanted)]
    visible = environ["CUDA_VISIBLE_DEVICES"].strip()
    devices = [d.strip() for d in visible.split(",")] if visible else []  # ("": no GPU at all)
    if wanted > len(devices):
        raise RunError(f"the run's workers take {wanted} GPUs, and CUDA_VISIBLE_DEVICES={visible} gives this driver "
                       f"{len(devices)}; give it more, or fewer workers or gpus_per_worker")
    return devices[:wanted]


class LocalLauncher:
    name = "local"

    def __init__(self, run_dir: RunDir, bind_host: str = "127.0.0.1"):
        self.run_dir, self.bind_host = run_dir, bind_host
        self.procs: dict[str, subprocess.Popen | Forked] = {}
        self.envs: dict[str, dict[str, str]] = {}  # each worker's environment, to start it again
        self._reported: set[str] = set()
        self.server: ForkServer | None = None  # (toolkit/launch/forkserver.py)

    def start(self, groups: list[WorkerGroup], env: dict[str, str]) -> None:
        asked = ", ".join(f"placement.{g.name}.gpus_per_worker {g.gpus_per_worker} x {g.workers} workers"
                          for g in groups if g.gpus_per_worker)
        gpus = visible_gpus({**os.environ, **env}, sum(g.workers * g.gpus_per_worker for g in groups), asked)
        if usable(groups):
            self.server = ForkServer({**os.environ, **env}, self.run_dir.logs / "fork-server.log")
        for group in groups:
            for rank, worker_id in enumerate(group.worker_ids()):
                child_env = {**os.environ, **env, **group.env, E.GROUP: group.name, E.RANK: str(rank)}
                child_env.setdefault(E.BIND_HOST, self.bind_host)
                child_env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # gloo listens on loopback only
                if group.cpus_per_worker:
                    child_env.setdefault("OMP_NUM_THREADS", str(group.cpus_per_worker))
                if group.gpus_per_worker:  # each worker sees only its own GPUs, as under Slurm
                    mine, gpus = gpus[:group.gpus_per_worker], gpus[group.gpus_per_worker:]
                    child_env["CUDA_VISIBLE_DEVICES"] = ",".join(mine)
                self.envs[worker_id] = child_env
                self._spawn(worker_id, child_env)

    def _spawn(self, worker_id: str, env: dict[str, str]) -> None:
        if self.server and self.server.fits(env):
            forked = self.server.spawn(worker_id, env, self.run_dir.log_file(worker_id))
            if forked:
                self.procs[worker_id] = forked
                return
        with open(self.run_dir.log_file(worker_id), "ab") as log:
            self.procs[worker_id] = subprocess.Popen(
                [sys.executable, "-m", "toolkit.worker"], env=env, stdin=subprocess.DEVNULL,
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=die_with_parent)

    def restarts_with(self, worker_id: str) -> list[str]:
        """The workers started again when `worker_id` is: itself alone (each worker is its own process)."""
        return [worker_id]

    def restart(self, worker_id: str, env: dict[str, str]) -> None:
        """Start worker `worker_id` again alone (with `env` added), after killing what is left of it (a hung
        worker, and whatever it started)."""
        old = self.procs[worker_id]
        _signal_group(old.pid, signal.SIGKILL)
        try:
            old.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        deadline = time.monotonic() + 10
        while _members([old.pid]) and time.monotonic() < deadline:
            time.sleep(0.1)
        self._remove_left(worker_id)
        self._reported.discard(worker_id)
        self._spawn(worker_id, {**self.envs[worker_id], **env})

    def step_id(self, group: str) -> None:
        return None  # no Slurm steps here

    def end_time(self) -> None:
        return None  # a local run has no time limit: SIGUSR1 stops it after the current step

    def describe(self, worker_id: str) -> str:
        proc = self.procs.get(worker_id)
        return f"pid {proc.pid} on this machine" if proc else "not started"

    def poll(self) -> list[Exit]:
        """Workers that exited since the last call (exit code negative: killed by that signal)."""
        exited = []
        for worker_id, proc in self.procs.items():
            if worker_id not in self._reported and proc.poll() is not None:
                self._reported.add(worker_id)
                self._remove_left(worker_id)  # (a worker killed by the OOM killer, say)
                exited.append(Exit(worker_id, proc.returncode))
        return exited

    def wait(self, timeout_s: float, leaving_out: list[str] = ()) -> bool:
        """Wait until every worker (but those `leaving_out`) exited by itself; True if they all did in time."""
        return wait_all([p for w, p in self.procs.items() if w not in leaving_out], timeout_s)

    def stop(self, grace_s: float = 5.0) -> None:
        """SIGTERM every worker's process group, SIGKILL what is left after `grace_s`, and reap."""
        groups = [p.pid for p in self.procs.values()]
        for pgid in groups:
            _signal_group(pgid, signal.SIGTERM)
            _signal_group(pgid, signal.SIGCONT)  # (a stopped worker acts on SIGTERM only once continued)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and _members(groups):
            for p in self.procs.values():
                p.poll()
            time.sleep(0.1)
        for pgid in groups:
            _signal_group(pgid, signal.SIGKILL)
        for p in self.procs.values():
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        deadline = time.monotonic() + 10
        while _members(groups) and time.monotonic() < deadline:
            time.sleep(0.1)
        for worker_id in self.procs.keys() - self._reported:  # (poll() removed those of the others)
            self._remove_left(worker_id)
        if self.server:
            self.server.close()

    def _remove_left(self, worker_id: str) -> None:
        """The worker's own temporary directory, if it was killed before it could remove it (tmpdir.py)."""
        remove_left(self.envs[worker_id], worker_id.replace(":", "-"), self.procs[worker_id].pid)


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _members(pgids: list[int]) -> list[int]:
    """Live (non-zombie) processes in any of the process groups `pgids`."""
    wanted, found = set(pgids), []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        state, pgrp = fields[0], int(fields[2])
        if pgrp in wanted and state != "Z":
            found.append(int(entry))
    return found
