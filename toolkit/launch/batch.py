"""The driver inside a Slurm allocation, for a run directory made by `submit` or `render`.

`python -m toolkit.launch.batch RUN_DIR` is the command of a rendered sbatch script; `submit` runs
`run_in_allocation(RUN_DIR)` through Submitit. Both start the same driver as `slurm-rlhf run` (or `sft`,
`rm`), with the Slurm launcher: one srun step per node group.
"""

from __future__ import annotations

import logging
import os
import signal
import sys

from toolkit.errors import ConfigError, RunError, ToolkitError


def run_in_allocation(run_dir: str) -> None:
    from toolkit.config import load_config
    from toolkit.launch.allocation import plan_allocation
    from toolkit.launch.env import node_name, resolve_bind_host
    from toolkit.launch.rundir import RunDir
    from toolkit.launch.slurm import SlurmLauncher
    from toolkit.launch.supervisor import make_driver, run_attempts
    from toolkit.log import setup_logging
    from toolkit.placement.plan import plan
    from toolkit.progress import Progress

    os.umask(0o077)
    # SIGUSR1 (the time limit is near) would end the process before the driver is listening for it.
    early_usr1 = []
    signal.signal(signal.SIGUSR1, lambda signum, frame: early_usr1.append(signum))
    if "SLURM_JOB_ID" not in os.environ:
        raise RunError("not inside a Slurm allocation (SLURM_JOB_ID is unset): submit the script that "
                       "`slurm-rlhf render` wrote with sbatch, or use `slurm-rlhf submit`")
    rd = RunDir(run_dir)
    private_slurm_files(rd)  # (a job refused below too: its own output files are among them)
    refuse_second_driver(rd, os.environ["SLURM_JOB_ID"])  # (before anything is written)
    setup_logging("driver", level=logging.WARNING, stream=sys.stdout, file=str(rd.logs / "driver.log"))
    try:
        cfg = load_config(rd.config)
    except ToolkitError as e:  # (e.g. a file it names is gone since the submit): `status` must say so
        rd.write_status({"state": "failed", "error": f"the run's config no longer loads: {e}"})
        raise
    rd.update_job(job_id=os.environ.get("SLURM_JOB_ID"), batch_node=node_name(), driver_pid=os.getpid())
    started_again = int(os.environ.get("SLURM_RESTART_COUNT") or 0)
    if started_again:  # (the cause is in the job's error file: slurmstepd's "CANCELLED ... DUE TO ...")
        print(f"job {os.environ['SLURM_JOB_ID']}: started again by Slurm (SLURM_RESTART_COUNT {started_again}): "
              "requeued after a lost node, a preemption or its time limit; the run resumes", flush=True)
    allocation = plan_allocation(plan(cfg), cfg.slurm.heterogeneous)
    echo = Progress(sys.stdout, live=False)

    def make():  # (a new driver and launcher for each attempt: new srun steps in this allocation)
        launcher = SlurmLauncher(rd, allocation, cfg.slurm.python or sys.executable, cfg.transport.bind_host)
        print(f"job {launcher.job_id}: run {cfg.run.name!r} in {rd.path}; node groups: "
              + ", ".join(f"{g} on {','.join(n)}" for g, n in launcher.nodes.items()), flush=True)
        driver = make_driver(cfg, rd, launcher, resolve_bind_host(cfg.transport.bind_host), echo=echo)
        driver.preempt = bool(early_usr1)
        driver.requeue = lambda: requeue(rd, cfg.slurm.max_requeues)  # (once its checkpoint is committed)
        return driver

    driver, _ = run_attempts(cfg, make, echo)
    if driver.state != "preempted":
        print(f"done: {driver.steps} steps; metrics in {rd.metrics}", flush=True)


def private_slurm_files(rd) -> None:
    """Make the files in RUN_DIR/slurm this user's alone (mode 600). slurmstepd creates the job's output
    files (`%j_0_log.out/err`: the driver's output, tracebacks, config values) before the batch script
    runs, with the umask sbatch was called with: world-readable after a hand-run `sbatch` under umask 022."""
    for path in (rd.path / "slurm").glob("*"):
        try:
            mode = path.stat().st_mode
            if path.is_file() and path.stat().st_uid == os.getuid() and mode & 0o077:
                path.chmod(mode & 0o700)
        except OSError:  # (a file removed meanwhile; one this user may not change is left as it is)
            continue


def refuse_second_driver(rd, job_id: str) -> None:
    """ConfigError if another Slurm job runs this directory (`sbatch job.sbatch` twice, or `resume --submit`
    beside a job submitted by hand): its driver holds job.lock, or job.json names another job that is still
    queued or running (a requeued one resumes by itself). Two drivers of one directory overwrite each
    other's status and checkpoints, and `status`, `cancel` and `resume` would act on whichever job wrote
    job.json last, not on the one that runs. Otherwise this process holds job.lock from now on."""
    from toolkit.launch.jobs import ended, slurm_job
    from toolkit.launch.pipeline import resume_target

    held = not rd.hold_job_lock()
    other = str(rd.read_json(rd.job).get("job_id") or "")
    state = slurm_job(other)["state"] if other and other != job_id else ""
    if not held and (not state or ended(state)):
        return
    runs = (f"slurm job {other} ({state})" if state else "another slurm job") + (
        ", whose driver holds job.lock" if held else "")
    raise ConfigError(f"{rd.path} is already run by {runs}: job {job_id} starts no second driver beside it. "
                      f"Leave that job be (`slurm-rlhf status {rd.path}`), or stop it with `slurm-rlhf cancel "
                      f"{rd.path}` and go on with `slurm-rlhf resume {resume_target(rd.path)} --submit`")


def requeue(rd, max_requeues: int) -> None:
    """Put this job ($SLURM_JOB_ID, not whichever job job.json names) back in the queue; the requeued job
    resumes the run by itself."""
    import subprocess

    from toolkit.launch.pipeline import resume_target

    job_id = os.environ["SLURM_JOB_ID"]
    count = rd.read_json(rd.job).get("requeues", 0)
    if count >= max_requeues:
        raise RunError(f"the job's time is up and it was already requeued {count} times (slurm.max_requeues); "
                       f"continue with: slurm-rlhf resume {resume_target(rd.path)} --submit")
    rd.update_job(requeues=count + 1)
    print(f"requeueing job {job_id} ({count + 1} of at most {max_requeues}); it will resume by itself",
          flush=True)
    try:
        subprocess.run(["scontrol", "requeue", job_id], check=True, capture_output=True, text=True,
                       timeout=60)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:
        said = (getattr(e, "stderr", None) or "").strip() or str(e)
        raise RunError(f"`scontrol requeue {job_id}` failed ({said}); the checkpoint is saved: continue "
                       f"with: slurm-rlhf resume {resume_target(rd.path)} --submit") from None


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m toolkit.launch.batch RUN_DIR   (inside a Slurm allocation)", file=sys.stderr)
        return 2
    try:
        run_in_allocation(args[0])
    except ToolkitError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return e.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
