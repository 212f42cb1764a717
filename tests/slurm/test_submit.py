"""`submit`, `status`, `cancel` on the real local Slurm cluster (bash slurm/up.sh 4; tools/test.sh does it).

What ran where is read from Slurm itself (squeue's view of each job step while the run is going, the
SLURMD_NODENAME each worker recorded) and compared with the plan; test_placement.py does it for a plain
Separation run, each role on nodes of its own.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from tests.conftest import cli, example, write_config

pytestmark = pytest.mark.slurm


@pytest.fixture(scope="module", autouse=True)
def cluster():
    try:
        out = subprocess.run(["sinfo", "-h", "-p", "debug", "-o", "%D %t"], capture_output=True, text=True, timeout=30)
    except FileNotFoundError:
        pytest.fail("Slurm is not installed; bring the local cluster up: bash slurm/up.sh 4")
    nodes = sum(int(line.split()[0]) for line in out.stdout.splitlines() if line.split()[1] in ("idle", "mix"))
    if out.returncode != 0 or nodes < 4:
        pytest.fail(f"the local Slurm cluster is not up with 4 free nodes ({out.stdout or out.stderr!r}); "
                    "run: bash slurm/up.sh 4")


def run_config(tiny, tmp_path, steps=3, run: dict | None = None, **sections) -> Path:
    sections.setdefault("trainer", {})
    sections["trainer"] = {"micro_batch_size": 8, **sections["trainer"]}
    return write_config(tmp_path, example("tiny-grpo.yaml", tiny, run={"steps": steps, "name": "slurm-test",
                                                                      **(run or {})}, **sections))


class StepWatcher(threading.Thread):
    """Records every job step Slurm reports for a job while it runs: {step name: (step id, node list)}."""

    def __init__(self, run_dir: Path):
        super().__init__(daemon=True)
        self.run_dir, self.steps, self.done = run_dir, {}, threading.Event()

    def run(self):
        while not self.done.is_set():
            job = self.job_id()
            if job:
                # steps of a heterogeneous job's component k are listed under job id <job> + k
                ids = {str(int(job) + k) for k in range(3)}
                out = subprocess.run(["squeue", "-h", "-s", "-o", "%i|%j|%N"], capture_output=True, text=True,
                                     timeout=30)
                for line in out.stdout.splitlines():
                    step, name, nodes = line.split("|")
                    if step.split(".")[0] in ids and name in ("generator", "scorer", "trainer"):
                        self.steps[name] = (step, nodes)
            time.sleep(0.5)

    def job_id(self):
        try:
            return str(json.loads((self.run_dir / "job.json").read_text())["job_id"])
        except (OSError, KeyError, ValueError):
            return None


def expand(nodelist: str) -> list[str]:
    return subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True,
                          check=True).stdout.split()


def submit_and_wait(config: Path, run_dir: Path, env: dict | None = None) -> tuple[subprocess.CompletedProcess, dict]:
    watcher = StepWatcher(run_dir)
    watcher.start()
    try:
        result = cli("submit", config, "--run-dir", run_dir, "--wait", env=env, timeout=600)
    finally:
        watcher.done.set()
        watcher.join()
    return result, watcher.steps


def run_processes(run_dir: Path) -> list[int]:
    """Processes of this run still alive on this machine (every virtual node is this machine)."""
    found, needle = [], f"SLURM_RLHF_RUN_DIR={run_dir}".encode()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    if needle in f.read().split(b"\0"):
                        with open(f"/proc/{entry}/stat") as s:
                            if s.read().rsplit(")", 1)[1].split()[0] != "Z":
                                found.append(int(entry))
            except OSError:
                pass
    return found


def assert_nothing_left(run_dir: Path, job_id: str) -> None:
    deadline = time.monotonic() + 30
    while (run_processes(run_dir) or squeue(job_id)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not run_processes(run_dir), f"processes of the run still alive: {run_processes(run_dir)}"
    assert not squeue(job_id), f"job {job_id} still queued: {squeue(job_id)}"


def squeue(job_id: str) -> str:
    return subprocess.run(["squeue", "-h", "-j", job_id], capture_output=True, text=True, timeout=30).stdout.strip()


def test_heterogeneous_job(tiny, tmp_path):
    """Also `transport.bind_host` as an interface name: every worker binds to that interface's address
    (before, it was not passed to the job steps, and each worker bound to its node's default address,
    here eth0's)."""
    from toolkit.launch.env import interface_addresses

    config = run_config(tiny, tmp_path, placement={"generator": {"partition": "front"},
                                                   "trainer": {"partition": "back"}}, transport={"bind_host": "lo"})
    dry = cli("submit", config, "--dry-run", "--run-dir", tmp_path / "dry", timeout=60)
    assert "a heterogeneous job of 3 components" in dry.stdout and dry.stdout.count("#SBATCH hetjob") == 2
    run_dir = tmp_path / "het"
    result, steps = submit_and_wait(config, run_dir)
    assert result.returncode == 0, result.stdout + result.stderr
    job_id = str(json.loads((run_dir / "job.json").read_text())["job_id"])
    job = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True).stdout
    assert f"HetJobId={job_id}" in job and "HetJobOffset=2" in job
    partition_nodes = {p: set(expand(subprocess.run(["sinfo", "-h", "-p", p, "-o", "%N"], capture_output=True,
                                                    text=True).stdout.strip())) for p in ("front", "back")}
    status = json.loads((run_dir / "status.json").read_text())
    assert status["workers"]["generator:0"]["node"] in partition_nodes["front"]
    assert status["workers"]["trainer:0"]["node"] in partition_nodes["back"]
    assert set(expand(steps["generator"][1])) <= partition_nodes["front"]
    assert set(expand(steps["trainer"][1])) <= partition_nodes["back"]
    nodes = [status["workers"][w]["node"] for w in ("generator:0", "scorer:0", "trainer:0")]
    assert len(set(nodes)) == 3
    loopback = interface_addresses()["lo"][0]
    for worker in status["workers"].values():
        assert worker["inbox"] is None or worker["inbox"].startswith(f"tcp://{loopback}:"), worker
        assert worker["store"] is None or worker["store"].startswith(f"{loopback}:"), worker
    assert_nothing_left(run_dir, job_id)


def test_wait_stops_following_a_job_that_will_not_start_by_itself(tiny, tmp_path):
    """`submit --wait` followed a held job (or one whose dependency failed, or that its partition's limits
    refuse) forever; it now names the reason, leaves the job queued as it says, and exits 1."""
    run_dir = tmp_path / "run"
    result = cli("submit", run_config(tiny, tmp_path, slurm={"sbatch": {"hold": True}}), "--run-dir", run_dir,
                 "--wait", timeout=120)
    job_id = str(json.loads((run_dir / "job.json").read_text())["job_id"])
    try:
        assert result.returncode == 1, result.stdout + result.stderr
        assert f"error: slurm job {job_id} stays pending: JobHeldUser (held by its user)" in result.stderr
        assert " PD " in squeue(job_id)  # (left in the queue, pending, as said)
    finally:
        subprocess.run(["scancel", job_id], capture_output=True, timeout=30)
    assert_nothing_left(run_dir, job_id)


def test_failing_role_ends_the_job_with_a_named_error(tiny, tmp_path):
    (tmp_path / "failing_reward.py").write_text(
        "def explode(prompt, response, **kw):\n    raise RuntimeError('this reward always fails')\n")
    env = {"PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    config = run_config(tiny, tmp_path, reward={"functions": [{"function": "failing_reward:explode"}]})
    run_dir = tmp_path / "fail"
    result, _ = submit_and_wait(config, run_dir, env=env)
    assert result.returncode == 1
    status = json.loads((run_dir / "status.json").read_text())
    error = status["error"]
    scorer = status["workers"]["scorer:0"]
    assert f"scorer worker rank 0 (scorer:0, pid {scorer['pid']} on node {scorer['node']}, Slurm step " \
           f"{scorer['slurm_step']}; roles reference, reward) failed" in error  # (the group's roles: it hosts two)
    assert "reward function 'explode' (failing_reward:explode) failed" in error
    assert f"log: {run_dir / 'logs' / 'scorer-0.log'}" in error
    assert "this reward always fails" in result.stderr  # `submit --wait` shows the error too
    job_id = str(json.loads((run_dir / "job.json").read_text())["job_id"])
    assert "FAILED" in cli("status", run_dir, timeout=60).stdout
    assert_nothing_left(run_dir, job_id)


def submit_long_run(tiny, tmp_path, name: str, **sections) -> tuple[Path, str]:
    """A long run submitted (without waiting) and past its first step: (run dir, job id)."""
    run_dir = tmp_path / name
    result = cli("submit", run_config(tiny, tmp_path, steps=500, **sections), "--run-dir", run_dir, timeout=120)
    assert result.returncode == 0, result.stderr
    job_id = str(json.loads((run_dir / "job.json").read_text())["job_id"])
    wait_for_step(run_dir)
    return run_dir, job_id


def test_a_killed_trainer_goes_on_from_its_checkpoint_in_the_same_allocation(tiny, tmp_path):
    """kill -9 of the trainer: the driver starts every worker again, as new srun steps of the same job,
    from the last checkpoint. Killed again, with run.max_trainer_restarts (1) used, the run fails with
    an error that names the trainer's step and node."""
    run_dir, job_id = submit_long_run(tiny, tmp_path, "kill", run={"max_trainer_restarts": 1}, checkpoint={"every_steps": 1})
    status = lambda: json.loads((run_dir / "status.json").read_text())  # noqa: E731
    first, killed_at = status()["workers"]["trainer:0"], status()["step"]
    os.kill(first["pid"], 9)
    deadline = time.monotonic() + 300
    while True:
        now = status()
        second = now["workers"]["trainer:0"]
        if second.get("pid") not in (None, first["pid"]) and now["state"] == "running" and now["step"] > killed_at:
            break
        assert time.monotonic() < deadline, f"the run did not go on after the trainer was killed: {now}"
        time.sleep(0.5)
    assert squeue(job_id), "the job ended"
    assert second["slurm_step"].split(".")[0] == first["slurm_step"].split(".")[0]  # the same job ...
    assert second["slurm_step"] != first["slurm_step"]  # ... a new step
    output = (run_dir / "slurm" / f"{job_id}_0_log.out").read_text()
    assert f"trainer worker rank 0 (trainer:0, pid {first['pid']} on node {first['node']}" in output
    assert "starting every worker again from the last checkpoint (restart 1 of run.max_trainer_restarts 1)" in output
    os.kill(second["pid"], 9)
    deadline = time.monotonic() + 60
    while squeue(job_id) and time.monotonic() < deadline:
        time.sleep(0.5)
    end = status()
    assert end["state"] == "failed"
    assert (f"trainer worker rank 0 (trainer:0, pid {second['pid']} on node {second['node']}, Slurm step "
            f"{second['slurm_step']}) exited with") in end["error"]
    assert f"srun: step {second['slurm_step']}, node {second['node']}: Killed" in end["error"]
    assert "the run was not started again: 1 restart(s) of run.max_trainer_restarts 1 used" in end["error"]
    assert_nothing_left(run_dir, job_id)


def submit_held(config: Path, run_dir: Path, hold: str, env: dict | None = None) -> tuple[str, int, dict]:
    """Submit a run whose first process to reach `hold` (toolkit/hold.py) waits there; once one does: (job id,
    its pid, status.json's workers)."""
    from toolkit.hold import ENV, held_pid

    result = cli("submit", config, "--run-dir", run_dir, env={ENV: hold, **(env or {})}, timeout=120)
    assert result.returncode == 0, result.stderr
    job_id = str(json.loads((run_dir / "job.json").read_text())["job_id"])
    deadline = time.monotonic() + 300
    while not (pid := held_pid(run_dir, hold)):
        assert squeue(job_id) and time.monotonic() < deadline, f"the job ended or stalled before {hold}"
        time.sleep(0.2)
    return job_id, pid, json.loads((run_dir / "status.json").read_text())["workers"]


def finished(run_dir: Path, job_id: str, timeout: float = 300) -> dict:
    """status.json once the job has ended, which it must have by `timeout` and as finished."""
    deadline = time.monotonic() + timeout
    while squeue(job_id) and time.monotonic() < deadline:
        time.sleep(0.5)
    status = json.loads((run_dir / "status.json").read_text())
    assert status["state"] == "finished", status.get("error")
    return status


def assert_experience_whole(run_dir: Path, steps: int) -> None:
    """Every step's committed experience has each sample group once."""
    from toolkit.store import experience

    for n in range(steps):
        s = experience.read(run_dir / "experience" / experience.file_name(n))["samples"]
        assert len(set(zip(s["group_index"].tolist(), s["sample_index"].tolist()))) == len(s["prompt_ids"]) == 64


def test_a_cancelled_generator_step_is_started_again_alone_in_the_same_allocation(tiny, tmp_path):
    """scancel of the generator's job step while it generates step 2: the driver starts the generator again
    alone, as a new step of the same job on the same node; the trainer's step goes on, and the run
    finishes with every step's experience whole."""
    run_dir = tmp_path / "gen"
    job_id, _, before = submit_held(run_config(tiny, tmp_path, steps=4), run_dir, "generating@3")
    step = before["generator:0"]["slurm_step"]
    subprocess.run(["scancel", step], check=True, timeout=30)
    status = finished(run_dir, job_id)
    after = status["workers"]
    assert after["trainer:0"]["pid"] == before["trainer:0"]["pid"]  # the trainer's step went on
    assert after["trainer:0"]["slurm_step"] == before["trainer:0"]["slurm_step"]
    new = after["generator:0"]["slurm_step"]
    assert new.split(".")[0] == step.split(".")[0] and new != step  # the same job, a new step ...
    assert after["generator:0"]["node"] == before["generator:0"]["node"]  # ... on the same node
    assert status["worker_restarts"] == {"generator:0": 1}
    output = (run_dir / "slurm" / f"{job_id}_0_log.out").read_text()
    assert f"generator worker rank 0 (generator:0, pid {before['generator:0']['pid']} on node" in output
    assert f"Slurm step {step}) exited with" in output
    assert "starting it again alone (restart 1 of run.max_worker_restarts 3)" in output
    assert f"Slurm step {new}) is back; the run goes on" in output
    assert_experience_whole(run_dir, 4)
    assert_nothing_left(run_dir, job_id)


def test_a_killed_generator_of_a_two_task_step_is_started_again_with_its_step(tiny, tmp_path):
    """Two generator workers in one srun step (one node); kill -9 of one of them while it generates step 2.
    srun ends the other task too (--kill-on-bad-exit), so the driver starts the whole step again, as a new
    step of the same job on the same node, each task at its rank; the trainer's step goes on, and the run
    finishes with every step's experience whole (before, a step of several tasks ended the run)."""
    run_dir = tmp_path / "two"
    config = run_config(tiny, tmp_path, steps=4, placement={"generator": {"workers": 2, "nodes": 1}})
    job_id, pid, before = submit_held(config, run_dir, "generating@3")
    killed = next(w for w in ("generator:0", "generator:1") if before[w]["pid"] == pid)
    other = "generator:1" if killed == "generator:0" else "generator:0"
    step = before[killed]["slurm_step"]
    assert before[other]["slurm_step"] == step  # (one step, two tasks)
    os.kill(pid, signal.SIGKILL)
    status = finished(run_dir, job_id)
    after = status["workers"]
    assert after["trainer:0"]["pid"] == before["trainer:0"]["pid"]  # the trainer's step went on
    assert after["scorer:0"]["pid"] == before["scorer:0"]["pid"]
    new = after[killed]["slurm_step"]
    assert new.split(".")[0] == step.split(".")[0] and new != step  # the same job, a new step ...
    assert after[other]["slurm_step"] == new
    for w in (killed, other):  # ... with both tasks, each on the node it had, as new processes
        assert after[w]["node"] == before[w]["node"] and after[w]["pid"] != before[w]["pid"]
        assert after[w]["inbox"] == before[w]["inbox"]  # (each listens where it did)
    assert status["worker_restarts"] == {"generator:0": 1, "generator:1": 1}
    output = (run_dir / "slurm" / f"{job_id}_0_log.out").read_text()
    assert f"({killed}, pid {pid} on node {before[killed]['node']}, Slurm step {step}) exited with" in output
    assert (f"starting it again with the other task(s) of its step, {other} (restart 1 of "
            "run.max_worker_restarts 3)") in output
    assert output.count("is back; the run goes on") == 2
    assert output.count("asking the trainer which samples of step(s)") == 1  # (once, for both)
    resent = re.findall(r"sending (\d+) of the 16 prompts of step \d+ again \(their samples were lost\)", output)
    assert resent and all(1 <= int(n) <= 16 for n in resent), output  # (the killed task's, at least)
    assert_experience_whole(run_dir, 4)
    assert_nothing_left(run_dir, job_id)


def test_a_hung_generator_is_started_again_while_slurm_is_slow_and_the_other_workers_hear_the_driver(tiny,
                                                                                                    tmp_path):
    """One of two generator tasks of a step, stopped (SIGSTOP) in step 2, is found hung by its missed
    heartbeats and started again with the other task (which was working), while Slurm is slow: the scancel of
    their step takes 22 s (a `scancel` first on the job's PATH that waits, then runs Slurm's; what a busy
    controller does), over the 12 s of silence the workers allow the driver (transport.heartbeat_timeout_s).
    The driver answers their heartbeats meanwhile, so the trainer and the scorer go on, and the run
    finishes (before, both ended themselves, and the run with them)."""
    slow = tmp_path / "slow-slurm"
    slow.mkdir()
    said = tmp_path / "scancel-calls"
    (slow / "scancel").write_text(f'#!/bin/sh\necho "$@" >> {said}\nsleep 22\nexec {shutil.which("scancel")} "$@"\n')
    (slow / "scancel").chmod(0o755)
    run_dir = tmp_path / "hung"
    config = run_config(tiny, tmp_path, steps=3, transport={"heartbeat_timeout_s": 12},
                        placement={"generator": {"workers": 2, "nodes": 1}})
    job_id, pid, before = submit_held(config, run_dir, "generating@2", env={"PATH": f"{slow}:{os.environ['PATH']}"})
    hung = next(w for w in ("generator:0", "generator:1") if before[w]["pid"] == pid)
    os.kill(pid, signal.SIGSTOP)  # (every node of this cluster is this machine)
    status = finished(run_dir, job_id, timeout=400)
    assert said.read_text().splitlines()[0] == f"--signal=KILL {before[hung]['slurm_step']}"
    after = status["workers"]
    for worker in ("trainer:0", "scorer:0"):  # neither ended itself while the driver waited for scancel
        assert after[worker]["pid"] == before[worker]["pid"]
    for worker in ("generator:0", "generator:1"):
        assert after[worker]["pid"] != before[worker]["pid"]
    assert status["worker_restarts"] == {"generator:0": 1, "generator:1": 1}
    output = (run_dir / "slurm" / f"{job_id}_0_log.out").read_text()
    assert f"({hung}, pid {pid} on node" in output.split("sent no heartbeat for")[0]
    assert "starting it again with the other task(s) of its step, generator:" in output
    assert output.count("is back; the run goes on") == 2
    assert_nothing_left(run_dir, job_id)


def wait_for_step(run_dir: Path, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if json.loads((run_dir / "status.json").read_text()).get("step", -1) >= 0:
                return
        except (OSError, ValueError):
            pass
        time.sleep(0.5)
    raise AssertionError(f"no step finished within {timeout} s")


def test_cancel_leaves_nothing_behind(tiny, tmp_path):
    run_dir, job_id = submit_long_run(tiny, tmp_path, "cancel")
    live = cli("status", run_dir, timeout=60).stdout
    assert f"slurm job {job_id}: RUNNING" in live and "run state: running" in live
    assert live.count("(running)") == 3, live  # each role's srun step, as Slurm lists it
    assert len(re.findall(r" \d+ s ago", live)) == 3, live  # when the driver last heard from each worker
    assert run_processes(run_dir), "no process of the run was found while it ran"
    started = time.monotonic()
    result = cli("cancel", run_dir, timeout=120)
    assert result.returncode == 0, result.stderr
    assert f"cancelled slurm job {job_id}" in result.stdout and time.monotonic() - started < 60
    assert_nothing_left(run_dir, job_id)
    assert "CANCELLED" in cli("status", run_dir, timeout=60).stdout


def test_a_job_larger_than_its_partition_is_not_submitted(tiny, tmp_path):
    """Five nodes from the 4-node default partition: this cluster's Slurm would queue such a job and never
    start it (PartitionNodeLimit); `submit` says so instead, and nothing is queued or left."""
    from tests.slurm.conftest import jobs_of_this_checkout

    config = run_config(tiny, tmp_path, placement={"trainer": {"workers": 3, "nodes": 3}},
                        trainer={"micro_batch_size": 4}, rollout={"prompts_per_step": 12})
    before = jobs_of_this_checkout()
    result = cli("submit", config, "--run-dir", tmp_path / "run", timeout=120)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "the job needs 5 nodes in partition debug, which has 4 (sinfo)" in result.stderr
    assert "placement.<group>.nodes" in result.stderr
    assert not (tmp_path / "run").exists() and jobs_of_this_checkout() == before
    assert cli("submit", config, "--run-dir", tmp_path / "run", "--dry-run").returncode == 0  # (pure: no sinfo)
