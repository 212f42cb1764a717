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
from tests.slurm.test_submit import assert_nothing_left, squeue
from toolkit.errors import RunError
from toolkit.hold import ENV, held_file, held_pid
from toolkit.launch.batch import requeue
from toolkit.launch.rundir import RunDir
from toolkit.store import experience

pytestmark = pytest.mark.slurm
# Each attempt's trainer is held in its third step (HOLD) until the test cuts its time limit to end at the
# first whole minute of the attempt's run at least 27 s away (cut_time_limit; Slurm's limits are whole
# minutes, so 27-87 s later) and signals it. The driver steps on while its estimate of a step (the longest
# of the last three), a checkpoint (+5 s) and slurm.stop_margin_s fit before the end
# (Supervisor._time_for_a_step). The RL run keeps a margin of 90 s, longer than any time left after the
# cut: each attempt stops after its held third step whatever the moment and the machine's speed, so the
# run stops after steps 3 and 6, and a few more steps end it in the third attempt. An SFT rank is held
# outside its step's time, with the default margin (15 s): its cut ends the attempt 27-31 s later, and
# the stage steps on after it.
STEPS = 12
HOLD = "training@3"
LONG_MIN = 30  # a time limit no attempt reaches
MARGIN_S = 90


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


def cut_time_limit(job_id: str, run_dir: Path, left_s: tuple[int, int] = (27, 87)) -> None:
    """Once the attempt's trainer holds at HOLD, end the attempt at the first whole minute of its run at
    least left_s[0] s away, once that is at most left_s[1] s away, and tell it as Slurm does
    (`--signal=B:USR1`); then let the trainer go on. The limit comes from what the attempt has run, so a
    slow start on a busy machine cannot use it up; the signal is sent here rather than left to
    slurmctld's periodic check."""
    marker = wait_for_hold(run_dir)
    low, high = left_s
    minutes = 0

    def in_reach() -> bool:
        nonlocal minutes
        ran = run_seconds(job_id)
        minutes = math.ceil((ran + low) / 60)
        return minutes * 60 - ran <= high

    wait_until(in_reach, f"a moment {low}-{high} s before a whole minute of the attempt's run")
    set_time_limit(job_id, minutes)
    subprocess.run(["scancel", "--batch", "--signal=USR1", job_id], check=True, timeout=30, capture_output=True)
    marker.unlink()


def wait_for_hold(run_dir: Path) -> Path:
    """Wait until the attempt's trainer holds at HOLD; returns the marker it wrote (its pid)."""
    wait_until(lambda: held_pid(run_dir, HOLD), "the attempt's trainer to hold", run_dir=run_dir)
    return held_file(run_dir, HOLD)


def let_go(run_dir: Path) -> None:
    """Let the last attempt's trainer go on from HOLD, where no time limit is cut."""
    wait_for_hold(run_dir).unlink()


def test_a_short_time_limit_is_survived_by_requeueing(tiny, tmp_path):
    """Twice, once an attempt has made progress, the job's time limit is cut to end 27-87 s later and the
    job is signalled: the driver sees that another step, its checkpoint and the stop margin do not fit,
    checkpoints, requeues the job, and the requeued job resumes by itself (the test gives it a long limit
    again). The third attempt finishes the run: every step once, the periodic checkpoints too."""
    config = write_config(tmp_path, example("tiny-grpo.yaml", tiny, run={"steps": STEPS, "name": "requeue"},
                                            checkpoint={"every_steps": 5},
                                            slurm={"time_min": LONG_MIN, "signal_lead_s": 30, "max_requeues": 4,
                                                   "stop_margin_s": MARGIN_S}))
    run_dir = tmp_path / "run"
    result = cli("submit", config, "--run-dir", run_dir, env={ENV: HOLD}, timeout=120)
    assert result.returncode == 0, result.stderr
    job_id = str(json.loads((run_dir / "job.json").read_text())["job_id"])
    for requeues in (1, 2):
        cut_time_limit(job_id, run_dir)
        wait_until(lambda: json.loads((run_dir / "job.json").read_text()).get("requeues", 0) >= requeues,
                   f"requeue {requeues}", run_dir=run_dir)
        assert steps_done(run_dir) == 3 * requeues  # (its held third step, then no room for another)
        set_time_limit(job_id, LONG_MIN)  # (a requeued job keeps the limit it is given)
    let_go(run_dir)
    wait_until(lambda: not squeue(job_id), "the job to end", run_dir=run_dir)
    job = json.loads((run_dir / "job.json").read_text())
    assert job["requeues"] == 2
    output = (run_dir / "slurm" / f"{job_id}_0_log.out").read_text()
    assert output.count("it will resume by itself") == 2 and output.count("resuming after step") == 2
    assert output.count("stopping after step") == 2  # the time-limit path: a checkpoint, then the stop
    assert "stopping after step 3 (SIGUSR1)" in output and "stopping after step 6 (SIGUSR1)" in output
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


def test_a_requeue_past_its_limit_or_refused_by_slurm_is_a_named_error(tmp_path, monkeypatch):
    """No requeue beyond slurm.max_requeues; a requeue that Slurm refuses (here: a job that does not exist)
    names the command and what Slurm said; both say how to go on. The job requeued is the driver's own
    ($SLURM_JOB_ID), whatever job.json names."""
    rd = RunDir(tmp_path)
    rd.update_job(job_id=5, requeues=2)
    monkeypatch.setenv("SLURM_JOB_ID", "999999")
    with pytest.raises(RunError, match=r"already requeued 2 times \(slurm.max_requeues\); continue with: "
                                       r"slurm-rlhf resume .* --submit"):
        requeue(rd, max_requeues=2)
    with pytest.raises(RunError, match=r"`scontrol requeue 999999` failed \(.*Invalid job id.*\); the checkpoint "
                                       r"is saved: continue with: slurm-rlhf resume .* --submit"):
        requeue(rd, max_requeues=3)


def test_a_job_requeued_by_slurm_resumes_by_itself(tiny, tmp_path):
    """Preemption with requeue, as Slurm does it: the running job is stopped (SIGTERM) in its third step and
    queued again; the new start resumes from the committed experience and finishes the run."""
    steps = 12
    config = write_config(tmp_path, example("tiny-grpo.yaml", tiny, run={"steps": steps, "name": "preempted"},
                                            checkpoint={"every_steps": 5}))
    run_dir = tmp_path / "run"
    result = cli("submit", config, "--run-dir", run_dir, env={ENV: HOLD}, timeout=120)
    assert result.returncode == 0, result.stderr
    job_id = str(json.loads((run_dir / "job.json").read_text())["job_id"])
    held = wait_for_hold(run_dir)
    held_by = held.read_text()
    busy = cli("resume", run_dir, timeout=60)  # (a second driver beside the job's is refused)
    assert busy.returncode == 2 and f"its slurm job {job_id} is RUNNING" in busy.stderr, busy.stderr
    subprocess.run(["scontrol", "requeue", job_id], check=True, timeout=60)
    wait_until(lambda: not squeue(job_id), "the requeued job to finish", run_dir=run_dir)
    status = json.loads((run_dir / "status.json").read_text())
    assert status["state"] == "finished", status.get("error")
    output = (run_dir / "slurm" / f"{job_id}_0_log.out").read_text()
    assert output.count("resuming after step") == 1
    committed = sorted(json.loads(line)["step"] for line in (run_dir / "manifest.jsonl").read_text().splitlines()
                       if '"kind": "experience"' in line)
    assert committed == list(range(steps))
    assert [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()] == \
        list(range(steps))
    assert held.read_text() == held_by  # (a moment is held once a run: the new start went through)
    assert_nothing_left(run_dir, job_id)
    done = cli("resume", run_dir, "--submit", timeout=60)  # (nothing submitted for a finished run)
    assert done.returncode == 0 and "nothing to resume" in done.stdout, done.stdout + done.stderr
    assert str(json.loads((run_dir / "job.json").read_text())["job_id"]) == job_id  # (no new job)


def test_an_sft_stage_survives_its_time_limit_by_requeueing(tiny, tmp_path):
    """The same path for a supervised stage: after the cut its driver steps on while a step fits (on a quiet
    machine here, about 40 steps; none on a busy one), its ranks checkpoint at a step boundary, the job
    requeues itself, and the requeued job resumes from that checkpoint and finishes every step once."""
    # After the cut the stage steps for at most 31 - 20.5 s (a step, a checkpoint's 5 s and the 15 s margin
    # before the end): 3 + about 50 steps of 0.2 s here, fewer than `steps` on a machine four times as fast.
    steps = 200
    config = {"stage": "sft", "run": {"name": "sft-requeue", "steps": steps, "seed": 1},
              "data": {"sources": [{"path": str(tiny / "pipeline.jsonl")}]}, "model": {"base": str(tiny / "model")},
              "train": {"batch_size": 128, "micro_batch_size": 16, "max_tokens": 64, "eval_every": 100},
              "checkpoint": {"every_steps": 1000},
              "slurm": {"time_min": LONG_MIN, "signal_lead_s": 30, "max_requeues": 2}}
    run_dir = tmp_path / "run"
    result = cli("submit", write_config(tmp_path, config), "--run-dir", run_dir, env={ENV: HOLD}, timeout=120)
    assert result.returncode == 0, result.stderr
    job_id = str(json.loads((run_dir / "job.json").read_text())["job_id"])
    cut_time_limit(job_id, run_dir, left_s=(27, 31))
    wait_until(lambda: json.loads((run_dir / "job.json").read_text()).get("requeues", 0) >= 1, "the requeue",
               run_dir=run_dir)
    stopped = steps_done(run_dir)
    assert 3 <= stopped < steps, f"the first attempt stopped after {stopped} of {steps} steps"
    set_time_limit(job_id, LONG_MIN)
    let_go(run_dir)
    wait_until(lambda: not squeue(job_id), "the job to end", run_dir=run_dir)
    output = (run_dir / "slurm" / f"{job_id}_0_log.out").read_text()
    assert output.count("resuming after step") == 1 and output.count("stopping at the ranks' next step boundary") == 1
    assert f"checkpoint of step {stopped} saved" in output and f"resuming after step {stopped}: " in output
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
    runs on the three nodes left and resumes from the checkpoint of step 5, every step once. (The node
    goes while the trainer is held in step 7.)"""
    steps = 12
    config = write_config(tmp_path, example("tiny-grpo.yaml", tiny, run={"steps": steps, "name": "node-lost"},
                                            checkpoint={"every_steps": 5}, trainer={"micro_batch_size": 8}))
    run_dir = tmp_path / "run"
    result = cli("submit", config, "--run-dir", run_dir, env={ENV: "training@7"}, timeout=120)
    assert result.returncode == 0, result.stderr
    job_id = str(json.loads((run_dir / "job.json").read_text())["job_id"])
    held = wait_for_hold(run_dir)
    held_by = held.read_text()
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
    assert output.count("resuming after step") == 1 and "checkpoint checkpoints/step-000005" in output
    records = [json.loads(line) for line in (run_dir / "manifest.jsonl").read_text().splitlines()]
    assert sorted(r["step"] for r in records if r["kind"] == "experience") == list(range(steps))
    assert [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()] == \
        list(range(steps))
    assert held.read_text() == held_by  # (a moment is held once a run: the new start went through)
    assert_nothing_left(run_dir, job_id)
