"""Surviving the time limit on the local Slurm cluster: a job whose limit is far shorter than the run
checkpoints and requeues itself on SIGUSR1, and every requeued job resumes by itself, until all steps ran."""

from __future__ import annotations

import json
import subprocess
import time

import pytest

from tests.conftest import cli, example, write_config
from tests.slurm.test_submit import assert_nothing_left, squeue, wait_for_step
from toolkit.store import experience

pytestmark = pytest.mark.slurm
STEPS = 200  # about 50 steps fit in one attempt here: at least 3 attempts even on a machine twice as fast


def test_a_short_time_limit_is_survived_by_requeueing(tiny, tmp_path):
    config = write_config(tmp_path, example("tiny-grpo.yaml", tiny, run={"steps": STEPS, "name": "requeue"},
                                            checkpoint={"every_steps": 50},
                                            slurm={"time_min": 1, "signal_lead_s": 30, "max_requeues": 8}))
    run_dir = tmp_path / "run"
    result = cli("submit", config, "--run-dir", run_dir, "--wait", timeout=1200)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr
    job = json.loads((run_dir / "job.json").read_text())
    print(f"finished across {job['requeues']} automatic requeues")
    assert job["requeues"] >= 2, f"finished after {job['requeues']} requeue(s); the test needs at least 2"
    assert result.stdout.count("it will resume by itself") == job["requeues"]
    assert result.stdout.count("resuming at step") == job["requeues"]
    assert json.loads((run_dir / "status.json").read_text())["state"] == "finished"
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(STEPS))
    committed = [json.loads(line) for line in (run_dir / "manifest.jsonl").read_text().splitlines()]
    steps = sorted(r["step"] for r in committed if r["kind"] == "experience")
    assert steps == list(range(STEPS)), "a step was committed twice or never"
    last = experience.read(run_dir / "experience" / experience.file_name(STEPS - 1))
    assert last["attrs"]["policy_version"] == STEPS - 1
    assert_nothing_left(run_dir, str(job["job_id"]))


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
    deadline = time.monotonic() + 600
    while squeue(job_id) and time.monotonic() < deadline:
        time.sleep(1)
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
