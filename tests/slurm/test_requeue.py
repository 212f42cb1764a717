"""Surviving the time limit on the local Slurm cluster: a job whose limit ends before the run checkpoints
and requeues itself on SIGUSR1, and every requeued job resumes by itself, until all steps ran."""

from __future__ import annotations

import json
import math
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import cli, example, write_config
from tests.slurm.test_submit import assert_nothing_left, squeue, wait_for_step
from toolkit.errors import RunError
from toolkit.launch.batch import requeue
from toolkit.launch.rundir import RunDir
from toolkit.store import experience

pytestmark = pytest.mark.slurm
# Enough that two attempts cannot finish the run: after the cut an attempt steps until 15 s before its
# end, up to about 30 s, and a quiet run here takes about 0.2 s a step (a CI run at e3cb583 finished all
# 240 steps in its second attempt, about 140 of them after the cut), so two attempts run at most about
# 2 x (150 + 3) steps; a busy machine only makes the steps slower.
STEPS = 600
LONG_MIN = 30  # a time limit no attempt reaches


def run_seconds(job_id: str) -> int:
    """How long the job's current attempt has run (squeue's %M: [days-][hours:]minutes:seconds)."""
    text = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%M"], capture_output=True, text=True,
                          timeout=30).stdout.strip()
    days, _, clock = text.rpartition("-")
    seconds = 0
    for part in clock.split(":"):
        seconds = seconds * 60 + int(part)
    return seconds + int(days or 0) * 86400


def set_time_limit(job_id: str, minutes: int) -> None:
    subprocess.run(["scontrol", "update", f"JobId={job_id}", f"TimeLimit={minutes}"], check=True, timeout=30,
                   capture_output=True)


def steps_done(run_dir: Path) -> int:
    try:
        return json.loads((run_dir / "status.json").read_text()).get("step", -1) + 1
    except (OSError, ValueError):
        return 0


def wait_until(condition, what: str, timeout_s: float = 600, run_dir: Path | None = None) -> None:
    """Wait for `condition`; with `run_dir`, `timeout_s` counts from the run's last step, so a busy machine
    that slows the steps fails nothing, and a run that stopped stepping is told in full."""
    progress, since = None, time.monotonic()
    while not condition():
        if run_dir is not None and (now := steps_done(run_dir)) != progress:
            progress, since = now, time.monotonic()
        if time.monotonic() - since >= timeout_s:
            told = f" (no step for {timeout_s:.0f} s){story(run_dir)}" if run_dir is not None else ""
            raise AssertionError(f"timed out waiting for {what}{told}")
        time.sleep(0.5)


def story(run_dir: Path) -> str:
    """What the job and its driver last said, for a failure's message: Slurm's view of the job, then the
    ends of its output, error and driver log."""
    job_id = str(json.loads((run_dir / "job.json").read_text())["job_id"])
    shown = subprocess.run(["scontrol", "-o", "show", "job", job_id], capture_output=True, text=True, timeout=30)
    told = [f"\nscontrol show job: {' '.join(w for w in shown.stdout.split() if w.split('=')[0] in SHOWN)}"]
    for path in (run_dir / "slurm" / f"{job_id}_0_log.out", run_dir / "slurm" / f"{job_id}_0_log.err",
                 run_dir / "logs" / "driver.log"):
        lines = path.read_text(errors="replace").splitlines()[-25:] if path.exists() else ["(none)"]
        told.append(f"--- the end of {path.name}:\n" + "\n".join(lines))
    return "\n".join(told)


SHOWN = {"JobState", "Reason", "Restarts", "RunTime", "TimeLimit", "StartTime", "EndTime", "ExitCode"}


def cut_time_limit(job_id: str) -> None:
    """End the running attempt 20-45 s from now (Slurm's limits are whole minutes), and tell it as Slurm
    does (`--signal=B:USR1`). The limit comes from what the attempt has run, so a slow start on a busy
    machine cannot use it up; the signal is sent here rather than left to slurmctld's periodic check."""
    wait_until(lambda: 15 <= run_seconds(job_id) % 60 <= 40, "a moment 20-45 s before a whole minute")
    set_time_limit(job_id, math.ceil(run_seconds(job_id) / 60))
    subprocess.run(["scancel", "--batch", "--signal=USR1", job_id], check=True, timeout=30, capture_output=True)


def test_a_short_time_limit_is_survived_by_requeueing(tiny, tmp_path):
    """Twice, once an attempt has made progress, the job's time limit is cut to end 20-45 s later and the
    job is signalled: the driver keeps stepping while a step and a checkpoint fit, checkpoints, requeues
    the job, and the requeued job resumes by itself (the test gives it a long limit again). The third
    attempt finishes the run."""
    config = write_config(tmp_path, example("tiny-grpo.yaml", tiny, run={"steps": STEPS, "name": "requeue"},
                                            checkpoint={"every_steps": 50},
                                            slurm={"time_min": LONG_MIN, "signal_lead_s": 30, "max_requeues": 4}))
    run_dir = tmp_path / "run"
    result = cli("submit", config, "--run-dir", run_dir, timeout=120)
    assert result.returncode == 0, result.stderr
    job_id = str(json.loads((run_dir / "job.json").read_text())["job_id"])
    for requeues in (1, 2):
        first = steps_done(run_dir)
        wait_until(lambda: steps_done(run_dir) >= first + 3, f"attempt {requeues} to run 3 steps", run_dir=run_dir)
        cut_time_limit(job_id)
        wait_until(lambda: json.loads((run_dir / "job.json").read_text()).get("requeues", 0) >= requeues,
                   f"requeue {requeues}", run_dir=run_dir)
        assert steps_done(run_dir) < STEPS
        set_time_limit(job_id, LONG_MIN)  # (a requeued job keeps the limit it is given)
    wait_until(lambda: not squeue(job_id), "the job to end", run_dir=run_dir)
    job = json.loads((run_dir / "job.json").read_text())
    assert job["requeues"] == 2
    output = (run_dir / "slurm" / f"{job_id}_0_log.out").read_text()
    assert output.count("it will resume by itself") == 2 and output.count("resuming at step") == 2
    assert output.count("stopping after step") == 2  # the time-limit path: a checkpoint, then the stop
    status = json.loads((run_dir / "status.json").read_text())
    assert status["state"] == "finished", status.get("error")
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(STEPS))
    committed = [json.loads(line) for line in (run_dir / "manifest.jsonl").read_text().splitlines()]
    steps = sorted(r["step"] for r in committed if r["kind"] == "experience")
    assert steps == list(range(STEPS)), "a step was committed twice or never"
    last = experience.read(run_dir / "experience" / experience.file_name(STEPS - 1))
    assert last["attrs"]["policy_version"] == STEPS - 1
    assert_nothing_left(run_dir, job_id)


def test_a_requeue_past_its_limit_or_refused_by_slurm_is_a_named_error(tmp_path):
    """No requeue beyond slurm.max_requeues; a requeue that Slurm refuses (here: a job that does not exist)
    names the command and what Slurm said; both say how to go on."""
    rd = RunDir(tmp_path)
    rd.update_job(job_id=999999, requeues=2)
    with pytest.raises(RunError, match=r"already requeued 2 times \(slurm.max_requeues\); continue with: "
                                       r"slurm-rlhf resume .* --submit"):
        requeue(rd, max_requeues=2)
    with pytest.raises(RunError, match=r"`scontrol requeue 999999` failed \(.*Invalid job id.*\); the checkpoint "
                                       r"is saved: continue with: slurm-rlhf resume .* --submit"):
        requeue(rd, max_requeues=3)


def test_a_job_requeued_by_slurm_resumes_by_itself(tiny, tmp_path):
    """Preemption with requeue, as Slurm does it: the running job is stopped (SIGTERM) and queued again;
    the new start resumes from the committed experience and finishes the run."""
    config = write_config(tmp_path, example("tiny-grpo.yaml", tiny, run={"steps": 60, "name": "preempted"},
                                            checkpoint={"every_steps": 20}))
    run_dir = tmp_path / "run"
    result = cli("submit", config, "--run-dir", run_dir, timeout=120)
    assert result.returncode == 0, result.stderr
    job_id = str(json.loads((run_dir / "job.json").read_text())["job_id"])
    wait_for_step(run_dir)
    subprocess.run(["scontrol", "requeue", job_id], check=True, timeout=60)
    wait_until(lambda: not squeue(job_id), "the requeued job to finish", run_dir=run_dir)
    status = json.loads((run_dir / "status.json").read_text())
    assert status["state"] == "finished", status.get("error")
    output = (run_dir / "slurm" / f"{job_id}_0_log.out").read_text()
    assert output.count("resuming at step") == 1
    steps = sorted(json.loads(line)["step"] for line in (run_dir / "manifest.jsonl").read_text().splitlines()
                   if '"kind": "experience"' in line)
    assert steps == list(range(60))
    assert [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()] == \
        list(range(60))
    assert_nothing_left(run_dir, job_id)


def test_an_sft_stage_survives_its_time_limit_by_requeueing(tiny, tmp_path):
    """The same path for a supervised stage: its ranks checkpoint at a step boundary, the job requeues
    itself, and the requeued job resumes from that checkpoint and finishes every step once."""
    steps = 400
    config = {"stage": "sft", "run": {"name": "sft-requeue", "steps": steps, "seed": 1},
              "data": {"sources": [{"path": str(tiny / "pipeline.jsonl")}]}, "model": {"base": str(tiny / "model")},
              "train": {"batch_size": 128, "micro_batch_size": 16, "max_tokens": 64, "eval_every": 100},
              "checkpoint": {"every_steps": 1000},
              "slurm": {"time_min": LONG_MIN, "signal_lead_s": 30, "max_requeues": 2}}
    run_dir = tmp_path / "run"
    result = cli("submit", write_config(tmp_path, config), "--run-dir", run_dir, timeout=120)
    assert result.returncode == 0, result.stderr
    job_id = str(json.loads((run_dir / "job.json").read_text())["job_id"])
    wait_until(lambda: steps_done(run_dir) >= 3, "the first steps", run_dir=run_dir)
    cut_time_limit(job_id)
    wait_until(lambda: json.loads((run_dir / "job.json").read_text()).get("requeues", 0) >= 1, "the requeue",
               run_dir=run_dir)
    stopped = steps_done(run_dir)
    assert stopped < steps, "the stage finished before its time limit was cut; raise its steps"
    set_time_limit(job_id, LONG_MIN)
    wait_until(lambda: not squeue(job_id), "the job to end", run_dir=run_dir)
    output = (run_dir / "slurm" / f"{job_id}_0_log.out").read_text()
    assert output.count("resuming at step") == 1 and output.count("stopping after step") == 1
    assert json.loads((run_dir / "status.json").read_text())["state"] == "finished"
    assert [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()] == \
        list(range(steps))
    checkpoints = [json.loads(line)["step"] for line in (run_dir / "manifest.jsonl").read_text().splitlines()
                   if '"kind": "checkpoint"' in line]
    assert checkpoints[0] < steps and checkpoints[-1] == steps  # the stop's own checkpoint, then the last
    assert (run_dir / "export" / "model.safetensors").exists()
    assert_nothing_left(run_dir, job_id)


def test_a_lost_node_requeues_the_job_and_it_finishes_on_the_nodes_left(tiny, tmp_path):
    """The generator's node set DOWN with scontrol (as Slurm does with a node that stops answering) and
    kept out (drained): Slurm cancels the job for the node failure and requeues it; the requeued job
    runs on the three nodes left and resumes from the checkpoint, every step once."""
    steps = 40
    config = write_config(tmp_path, example("tiny-grpo.yaml", tiny, run={"steps": steps, "name": "node-lost"},
                                            checkpoint={"every_steps": 5}, trainer={"micro_batch_size": 8}))
    run_dir = tmp_path / "run"
    result = cli("submit", config, "--run-dir", run_dir, timeout=120)
    assert result.returncode == 0, result.stderr
    job_id = str(json.loads((run_dir / "job.json").read_text())["job_id"])
    wait_for_step(run_dir)
    node = json.loads((run_dir / "status.json").read_text())["workers"]["generator:0"]["node"]
    try:
        for state in ("DOWN", "DRAIN"):
            subprocess.run(["scontrol", "update", f"NodeName={node}", f"State={state}", "Reason=slurm-rlhf-test"],
                           check=True, timeout=30, capture_output=True)
        wait_until(lambda: not squeue(job_id), "the requeued job to finish", run_dir=run_dir)
    finally:  # (the node back for the tests after this one: idle, and answering again)
        subprocess.run(["scontrol", "update", f"NodeName={node}", "State=RESUME"], timeout=30, capture_output=True)
        wait_until(lambda: subprocess.run(["sinfo", "-h", "-n", node, "-o", "%t"], capture_output=True, text=True,
                                          timeout=30).stdout.strip() in ("idle", "mix"), f"node {node} back", 180)
    status = json.loads((run_dir / "status.json").read_text())
    assert status["state"] == "finished", status.get("error")
    assert node not in {w["node"] for w in status["workers"].values()}  # (the nodes left)
    slurm = run_dir / "slurm"
    assert "DUE TO NODE FAILURE" in (slurm / f"{job_id}_0_log.err").read_text()
    output = (slurm / f"{job_id}_0_log.out").read_text()
    assert f"job {job_id}: started again by Slurm (SLURM_RESTART_COUNT 1)" in output
    assert output.count("resuming at step") == 1
    records = [json.loads(line) for line in (run_dir / "manifest.jsonl").read_text().splitlines()]
    assert sorted(r["step"] for r in records if r["kind"] == "experience") == list(range(steps))
    assert [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()] == \
        list(range(steps))
    assert_nothing_left(run_dir, job_id)
