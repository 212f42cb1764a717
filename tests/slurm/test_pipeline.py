"""A pipeline on the local Slurm cluster: three jobs chained with --dependency=afterok, each stage reading
the model the one before it exported; the SFT stage's DeepSpeed ranks as one job step over two nodes;
`status` shows every stage; a failed stage stops the chain with its cause named."""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import EXAMPLES, cli, write_config
from tests.slurm.test_submit import squeue

pytestmark = pytest.mark.slurm


def job_of(run_dir: Path) -> dict:
    path = run_dir / "job.json"
    return json.loads(path.read_text()) if path.exists() else {}


def scontrol(job_id: str) -> dict:
    out = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, timeout=30).stdout
    return dict(f.split("=", 1) for f in out.split() if "=" in f)


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_pipeline_runs_as_three_chained_jobs(tiny, tmp_path):
    run_dir = tmp_path / "pipeline"
    sets = ["--set", "sft.placement.trainer.workers=2", "--set", "sft.placement.trainer.nodes=2",
            "--set", "sft.train.micro_batch_size=8", "--set", "rl.run.steps=20"]
    dry = cli("submit", EXAMPLES / "tiny-pipeline.yaml", "--run-dir", run_dir, "--dry-run", *sets)
    assert dry.returncode == 0 and dry.stdout.count("node group") == 3 and "--dependency=afterok" in dry.stdout
    assert not run_dir.exists()
    result = cli("submit", EXAMPLES / "tiny-pipeline.yaml", "--run-dir", run_dir, *sets, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    jobs = {stage: str(job_of(run_dir / stage)["job_id"]) for stage in ("sft", "rm", "rl")}
    # rm waits for sft, rl for rm: Slurm holds them on their dependency
    assert scontrol(jobs["rm"])["Dependency"].startswith(f"afterok:{jobs['sft']}")
    assert scontrol(jobs["rl"])["Dependency"].startswith(f"afterok:{jobs['rm']}")
    live = cli("status", run_dir, timeout=60).stdout
    assert all(f" {job} " in live for job in jobs.values()) and "waits for job" in live
    busy = cli("resume", run_dir, "--submit", timeout=60)  # (its jobs are queued: none submitted twice)
    assert busy.returncode == 2 and f"is still running: stage sft's slurm job {jobs['sft']} is " in busy.stderr, \
        busy.stderr
    deadline = time.monotonic() + 900
    while any(squeue(job) for job in jobs.values()) and time.monotonic() < deadline:
        time.sleep(2)
    final = cli("status", run_dir, timeout=60).stdout
    for stage in ("sft", "rm", "rl"):
        status = json.loads((run_dir / stage / "status.json").read_text())
        assert status["state"] == "finished", (stage, status.get("error"), final)
        assert (run_dir / stage / "export" / "config.json").exists()
        assert f"model: {run_dir / stage / 'export'}" in final
    assert final.count("COMPLETED") == 3
    done = cli("resume", run_dir, "--submit", timeout=60)
    assert done.returncode == 0 and "every stage finished, nothing to resume" in done.stdout, done.stdout + done.stderr
    assert {stage: str(job_of(run_dir / stage)["job_id"]) for stage in jobs} == jobs  # (nothing submitted)
    # the SFT ranks ran as one job step on two nodes
    sft = json.loads((run_dir / "sft" / "status.json").read_text())["workers"]
    assert sorted(w["node"] for w in sft.values()) == ["n1", "n2"]
    # each stage started after the one before had finished, and read its export
    starts = {stage: scontrol(job) for stage, job in jobs.items()}
    assert starts["sft"]["EndTime"] <= starts["rm"]["StartTime"] <= starts["rm"]["EndTime"] <= starts["rl"]["StartTime"]
    rl_config = (run_dir / "rl" / "config.yaml").read_text()
    assert f"actor: {run_dir / 'sft' / 'export'}" in rl_config and f"path: {run_dir / 'rm' / 'export'}" in rl_config
    rm = [r for r in metrics(run_dir / "rm") if "eval_accuracy" in r]
    assert rm[-1]["eval_accuracy"] >= 0.9
    true_reward = [r["reward/true_reward"] for r in metrics(run_dir / "rl")]
    assert sum(true_reward[-5:]) / 5 > true_reward[0] + 0.2, true_reward  # RL with the learned reward works


def test_a_pipeline_is_submitted_whole_or_not_at_all(tiny, tmp_path):
    """A stage that sbatch refuses (the rl stage's reservation does not exist) cancels the stages submitted
    before it, and the pipeline directory goes: none of it runs, and nothing is in the way of the same
    `submit` once the file is fixed. A stage that Slurm would keep waiting (more nodes than the partition has)
    or whose partition does not exist is named before any job is submitted, and an empty directory made for
    the pipeline is left as it was."""
    from tests.slurm.conftest import jobs_of_this_checkout
    from toolkit.launch.jobs import slurm_job

    run_dir = tmp_path / "pipeline"
    refused = cli("submit", EXAMPLES / "tiny-pipeline.yaml", "--run-dir", run_dir, "--set",
                  "rl.slurm.sbatch.reservation=nosuch", timeout=180)
    assert refused.returncode == 1, refused.stdout + refused.stderr
    assert "stage rl: sbatch refused the job" in refused.stderr and "reservation" in refused.stderr, refused.stderr
    cancelled = re.findall(r"\ncancelled the stages submitted before it, so that none of the pipeline runs: "
                           r"sft \(job (\d+)\), rm \(job (\d+)\)\n", refused.stderr + "\n")
    assert len(cancelled) == 1, refused.stderr
    cancelled = [("sft", cancelled[0][0]), ("rm", cancelled[0][1])]
    assert all(slurm_job(job)["state"] == "CANCELLED" for _, job in cancelled)
    assert not run_dir.exists()

    run_dir.mkdir()
    before = jobs_of_this_checkout()
    nowhere = cli("submit", EXAMPLES / "tiny-pipeline.yaml", "--run-dir", run_dir, "--set", "rl.slurm.partition=nosuch",
                  timeout=180)
    assert nowhere.returncode == 2, nowhere.stdout + nowhere.stderr
    assert ("stage rl: slurm.partition: there is no partition 'nosuch' on this cluster (sinfo lists debug (default), "
            "front, back); name one of those") in nowhere.stderr
    too_big = ["--set", "rl.placement.trainer.workers=3", "--set", "rl.placement.trainer.nodes=3",
               "--set", "rl.trainer.micro_batch_size=4", "--set", "rl.rollout.prompts_per_step=12"]
    waiting = cli("submit", EXAMPLES / "tiny-pipeline.yaml", "--run-dir", run_dir, *too_big, timeout=180)
    assert waiting.returncode == 2, waiting.stdout + waiting.stderr
    assert "stage rl: the job needs 5 nodes in partition debug, which has 4 (sinfo)" in waiting.stderr, waiting.stderr
    assert jobs_of_this_checkout() == before and run_dir.is_dir() and not list(run_dir.iterdir())


def test_a_failed_stage_stops_the_chain_with_its_cause(tiny, tmp_path):
    """The SFT stage's data goes missing after the submit (a file system problem): SFT fails, and Slurm
    cancels the reward-model stage that depended on it; `status` says which and why."""
    sft_rows = tmp_path / "sft-rows.jsonl"
    sft_rows.write_text((tiny / "pipeline.jsonl").read_text())
    pipeline = {"pipeline": {"name": "failing"},
                "data": {"sources": [{"path": str(tiny / "pipeline.jsonl")}], "split": {"sft": 1, "rm": 1}},
                "sft": {"data": {"sources": [{"path": str(sft_rows)}]}, "run": {"steps": 2},
                        "model": {"base": str(tiny / "model")}, "train": {"batch_size": 16, "micro_batch_size": 16}},
                "rm": {"run": {"steps": 2}, "model": {"base": "sft"}, "train": {"batch_size": 16, "micro_batch_size": 16}}}
    config = write_config(tmp_path, pipeline, "pipeline.yaml")
    run_dir = tmp_path / "run"
    result = cli("submit", config, "--run-dir", run_dir, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    sft_rows.unlink()
    jobs = [str(job_of(run_dir / stage)["job_id"]) for stage in ("sft", "rm")]
    deadline = time.monotonic() + 300
    while any(squeue(job) for job in jobs) and time.monotonic() < deadline:
        time.sleep(1)
    assert not any(squeue(job) for job in jobs)
    sft = json.loads((run_dir / "sft" / "status.json").read_text())
    assert sft["state"] == "failed" and "no such file or directory" in sft["error"] and str(sft_rows) in sft["error"]
    assert scontrol(jobs[1]).get("JobState") == "CANCELLED" or not scontrol(jobs[1])  # never ran
    assert not (run_dir / "rm" / "status.json").exists()
    status = cli("status", run_dir, timeout=60).stdout
    sft_line = next(line for line in status.splitlines() if line.startswith("sft"))
    rm_line = next(line for line in status.splitlines() if line.startswith("rm"))
    assert "failed" in sft_line and "sft: the run's config no longer loads" in status
    assert str(sft_rows) in status
    assert "not run: sft did not finish" in rm_line
