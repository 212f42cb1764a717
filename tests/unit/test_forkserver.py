"""The local launcher's fork server (toolkit/launch/forkserver.py), a real one: which environments it takes,
what it reports of a worker it forked, and what happens when it is gone. (Whole runs through it, stopped and
killed at every moment, are in tests/integration.)"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from tests.conftest import alive
from toolkit.launch.forkserver import ForkServer, usable
from toolkit.placement.plan import WorkerGroup


def test_a_fork_server_starts_workers_reports_their_end_and_is_not_used_once_gone(tmp_path):
    server = ForkServer({**os.environ}, tmp_path / "fork-server.log")
    try:
        # What differs is read at run time (our contract, gloo's interface, the thread count): a fork is the
        # same worker. Anything else (here PYTHONPATH, read when the interpreter starts) is not.
        assert server.fits({**os.environ, "SLURM_RLHF_GROUP": "g", "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"})
        assert not server.fits({**os.environ, "PYTHONPATH": "/elsewhere"})
        assert not server.fits({k: v for k, v in os.environ.items() if k != "PATH"})

        # A worker without the launcher's contract fails at once, as `python -m toolkit.worker` would.
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_RLHF_")}
        worker = server.spawn("w:0", env, tmp_path / "w-0.log")
        assert worker is not None and worker.pid != server.proc.pid
        assert worker.wait(timeout=120) == 1 and worker.poll() == 1
        log = (tmp_path / "w-0.log").read_text()
        assert "SLURM_RLHF_RUN_DIR" in log, log  # (the missing variable is named in the worker's own log)
        assert f"fork server (pid {server.proc.pid}): importing torch" in (tmp_path / "fork-server.log").read_text()
        assert "fork server: ready in" in (tmp_path / "fork-server.log").read_text()
    finally:
        server.proc.send_signal(signal.SIGKILL)  # (as if it died: the launcher then starts workers itself)
        server.proc.wait(timeout=10)
    assert server.spawn("w:1", env, tmp_path / "w-1.log") is None
    server.close()  # (nothing left to end)
    assert not alive([server.proc.pid])


PIDS_CGROUPS = Path("/sys/fs/cgroup/pids")  # (cgroup v1's process-count controller, as on these machines)


@pytest.mark.skipif(not os.access(PIDS_CGROUPS / "cgroup.procs", os.W_OK),
                    reason="needs a writable cgroup v1 pids controller to hold the fork server at its process limit")
def test_a_fork_that_fails_leaves_the_server_serving_and_the_worker_to_a_fresh_interpreter(tmp_path):
    server = ForkServer({**os.environ}, tmp_path / "fork-server.log")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_RLHF_")}
    limit = PIDS_CGROUPS / f"slurm-rlhf-test-{os.getpid()}"
    try:
        first = server.spawn("w:0", env, tmp_path / "w-0.log")  # (after the server's imports)
        assert first is not None and first.wait(timeout=120) == 1
        limit.mkdir()
        (limit / "cgroup.procs").write_text(str(server.proc.pid))
        (limit / "pids.max").write_text((limit / "pids.current").read_text())  # (no room for one more process)

        assert server.spawn("w:1", env, tmp_path / "w-1.log") is None
        assert server.proc.poll() is None and not server.gone  # (it serves on: its other workers live)
        assert "cannot fork worker w:1 (BlockingIOError" in (tmp_path / "w-1.log").read_text()
        assert "fork server: cannot fork worker w:1: BlockingIOError" in (tmp_path / "fork-server.log").read_text()

        (limit / "pids.max").write_text("max")
        again = server.spawn("w:2", env, tmp_path / "w-2.log")
        assert again is not None and again.wait(timeout=120) == 1
    finally:
        if limit.exists():
            if server.proc.poll() is None:
                (PIDS_CGROUPS / "cgroup.procs").write_text(str(server.proc.pid))
            limit.rmdir()
        server.close()
    assert not alive([server.proc.pid])


@pytest.mark.parametrize("more_workers_than_cores,gpus,switch,expected",
                         [(True, 0, None, True), (False, 0, None, False), (True, 1, None, False), (True, 0, "0", False),
                          (False, 0, "1", True), (False, 1, "1", False)])
def test_the_fork_server_is_used_with_more_workers_than_cores_without_gpus_or_as_switched(
        monkeypatch, more_workers_than_cores, gpus, switch, expected):
    monkeypatch.delenv("SLURM_RLHF_FORK_SERVER", raising=False)
    if switch is not None:
        monkeypatch.setenv("SLURM_RLHF_FORK_SERVER", switch)
    cores = len(os.sched_getaffinity(0))
    groups = [WorkerGroup("trainer", ("trainer",), cores, 0, gpus)]
    if more_workers_than_cores:
        groups.append(WorkerGroup("scorer", ("reference",), 1))
    on_this_machine = not any(os.path.exists(d) for d in ("/dev/nvidiactl", "/dev/kfd"))
    assert usable(groups) == (expected and on_this_machine)
