"""`slurm-rlhf status RUN_DIR` and `slurm-rlhf cancel RUN_DIR`, for Slurm jobs and local runs alike, and
whether a run's Slurm job is still queued or running.

Both read the run directory: job.json (the Slurm job id, or the local driver's pid) and status.json
(the driver's view: state, step, and every worker's node, step id, phase and policy_version).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from toolkit.errors import ConfigError, Interrupted, RunError
from toolkit.launch.env import node_name
from toolkit.launch.pipeline import resume_target
from toolkit.launch.rundir import RunDir
from toolkit.store.manifest import Manifest
from toolkit.table import text_table

ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY", "BOOT_FAIL",
         "DEADLINE"}
# Reasons a pending job gives when it will not start until someone acts (squeue's %r; Slurm's job_reason
# list): `--wait` stops following it and says so, rather than wait forever.
STUCK = {"JobHeldUser": "held by its user",
         "JobHeldAdmin": "held by an administrator",
         "DependencyNeverSatisfied": "a job it depends on failed",
         "BadConstraints": "no node of its partition has what it asks for",
         "PartitionTimeLimit": "its time limit is over its partition's",
         "PartitionNodeLimit": "it asks for more nodes than its partition allows",
         "InvalidAccount": "its account is not valid",
         "InvalidQOS": "its QOS is not valid",
         "AssocMaxWallDurationPerJobLimit": "its time limit is over its account's",
         "QOSMaxWallDurationPerJobLimit": "its time limit is over its QOS's"}


def ended(state: str) -> bool:
    """Whether a Slurm job in this state will not run again (UNKNOWN: slurmctld no longer knows it)."""
    word = (state.split() or [""])[0]
    return word in ENDED or word == "UNKNOWN"


def open_run(path: str | os.PathLike, hint: str = "") -> RunDir:
    """The run in `path`; ConfigError if it holds none (`hint`: what else the command takes)."""
    rd = RunDir(path)
    if not rd.config.exists():
        raise ConfigError(f"{rd.path} is not a run directory (no config.yaml){hint}")
    return rd


def slurm_job(job_id: str) -> dict:
    """{state, nodes, elapsed, reason} of a Slurm job, from squeue while queued or running, else scontrol. A
    controller that does not answer gives the state UNREACHABLE, which has not ended: Slurm says `Invalid job
    id` of a job it no longer knows (UNKNOWN), and a job of a busy controller may well be running."""
    out = _ask(["squeue", "-h", "-j", job_id, "-o", "%T|%N|%M|%r"])
    rows = [r.split("|") for r in out.stdout.splitlines() if r.strip()]
    if rows:  # (a heterogeneous job has one row per component: their nodes together, a pending one's none)
        state, _, elapsed, reason = rows[0]
        return {"state": state, "nodes": ",".join(r[1] for r in rows if r[1]), "elapsed": elapsed, "reason": reason}
    info = _ask(["scontrol", "show", "job", "-o", job_id])
    # (one line per component of a heterogeneous job: the first one's state, every component's nodes)
    components = [fields for fields in (dict(f.split("=", 1) for f in line.split() if "=" in f)
                                        for line in info.stdout.splitlines()) if fields]
    if components:
        first = components[0]
        nodes = ",".join(c["NodeList"] for c in components if c.get("NodeList") not in (None, "", "(null)"))
        return {"state": first.get("JobState", "?"), "nodes": nodes, "elapsed": first.get("RunTime", ""),
                "reason": first.get("Reason", "")}
    said = (info.stderr.strip() or out.stderr.strip() or "no answer").splitlines()[-1]
    if info.returncode and "Invalid job id" not in said:
        return {"state": f"UNREACHABLE (Slurm did not answer: {said})", "nodes": "", "elapsed": "", "reason": ""}
    return {"state": "UNKNOWN (no longer known to slurmctld)", "nodes": "", "elapsed": "", "reason": ""}


def _ask(command: list[str], timeout_s: float = 30) -> subprocess.CompletedProcess:
    """A Slurm command's answer; one that does not come within `timeout_s`, or cannot run (not in PATH on
    this node), is a failed command."""
    try:
        return subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return subprocess.CompletedProcess(command, 1, "", f"{command[0]}: no answer within {timeout_s:.0f} s")
    except OSError as e:
        return subprocess.CompletedProcess(command, 127, "", f"{command[0]} could not run here ({e.strerror}; "
                                                              "is Slurm in PATH on this node?)")


def running_steps(job_id: str, components: int = 8) -> set[str]:
    """Ids of the job's steps Slurm lists as running (a heterogeneous job's component k is <job>+k)."""
    out = _ask(["squeue", "-h", "-s", "-o", "%i"])
    ids = {str(int(job_id) + k) for k in range(components)}
    return {step for step in out.stdout.split() if step.split(".")[0] in ids}


def status_text(rd: RunDir) -> str:
    job = rd.read_json(rd.job)
    status = rd.read_json(rd.status)
    lines = [f"run directory: {rd.path}"]
    steps: set[str] = set()
    if job.get("job_id"):
        s = slurm_job(str(job["job_id"]))
        if s["state"] == "RUNNING":
            steps = running_steps(str(job["job_id"]), len(status.get("workers", {})) or 8)
        lines.append(f"slurm job {job['job_id']}: {s['state']}" + (f" on {s['nodes']}" if s["nodes"] else "")
                     + (f", elapsed {s['elapsed']}" if s["elapsed"] else "")
                     + (f" ({s['reason']})" if s["reason"] and s["reason"] != "None" else ""))
        lines.append(f"job output: {rd.path / 'slurm' / (str(job['job_id']) + '_0_log.out')}")
    if not status:
        holder = rd.running_driver()
        lines.append(f"driver: starting (pid {holder['pid']}); its workers are not started yet" if holder.get("pid")
                     else "driver: not started yet")
        return "\n".join(lines)
    step = status.get("step", -1)
    lines.append(f"run state: {state_text(rd, status)}, steps done: {max(step + 1, 0)}/{status.get('steps') or '?'}")
    resumes = sum(1 for r in Manifest(rd.path).records() if r["kind"] == "resume")
    requeues = job.get("requeues", 0)
    if resumes or requeues:  # (a job requeued and still waiting to start again has not resumed yet)
        lines.append("restarts: " + "; ".join(filter(None, [
            f"resumed {resumes} time(s) from its checkpoint and experience" if resumes else "",
            f"slurm job requeued {requeues} time(s) by its driver at its time limit"
            + (" (the requeued job has not resumed yet)" if requeues > resumes else "") if requeues else ""])))
    if status.get("worker_restarts"):
        lines.append("restarts: " + restarts_text(status["worker_restarts"]))
    if status.get("error"):
        lines.append("error: " + status["error"])
    last = status.get("last_metrics")
    if last:
        lines.append("last step: " + "  ".join(f"{k} {last[k]:.4g}" for k in
                                                ("reward_mean", "kl", "loss", "accuracy", "eval_loss",
                                                 "eval_accuracy", "generate_s", "train_s", "sync_s", "step_s",
                                                 "tokens_per_s")
                                                if isinstance(last.get(k), (int, float))))
    lines += eval_lines(rd.path)
    rows = [("worker", "node", "pid", "slurm step", "phase", "step", "policy_version", "last heard")]
    running = status["state"] in ("starting", "running")
    for worker_id, w in status.get("workers", {}).items():
        step = w.get("slurm_step") or "-"
        if steps and step != "-":
            step += " (running)" if step in steps else " (ended)"
        heard = f"{max(0.0, time.time() - w['heard_unix']):.0f} s ago" if running and "heard_unix" in w else "-"
        rows.append((worker_id, str(w.get("node", "-")), str(w.get("pid", "-")), step,
                     str(w.get("phase", "-")), _step_number(w.get("step")), str(w.get("policy_version", "-")), heard))
    lines.append(text_table(rows))
    return "\n".join(lines)


def _step_number(step) -> str:
    """A worker's step (counted from 0 in its heartbeats) as the progress line numbers it, from 1."""
    return str(step + 1) if isinstance(step, int) else "-"


def eval_lines(path: Path) -> list[str]:
    """A line per set of prompts that `slurm-rlhf eval` scored the run's checkpoints on, and for the run's
    own evaluations (`in-run`): the newest one's reward, and how many there are."""
    from toolkit.store.manifest import read_jsonl
    from toolkit.use.evaluate import IN_RUN

    lines = []
    for summary in sorted(path.glob("eval/*/summary.jsonl")):
        records = read_jsonl(summary)
        if records:
            last = records[-1]
            what = "evaluation(s) in the run" if summary.parent.name == IN_RUN else "checkpoint(s) scored"
            lines.append(f"eval {summary.parent.name}: step {last['step']} reward {last['reward_mean']:+.4f} "
                         f"({len(records)} {what}; {summary})")
    return lines


def restarts_text(restarts: dict[str, int]) -> str:
    """How often each worker was started again, consecutive ranks of a group started as often in one
    range (a Slurm step of 8 tasks restarts whole: `generator:0-7 started again 1 time(s)`)."""
    runs: list[list] = []  # [group, first rank, last rank, times]
    for group, rank, times in sorted((w.split(":")[0], int(w.split(":")[1]), n) for w, n in restarts.items()):
        if runs and runs[-1][0] == group and runs[-1][2] == rank - 1 and runs[-1][3] == times:
            runs[-1][2] = rank
        else:
            runs.append([group, rank, rank, times])
    return ", ".join(f"{group}:{first}{f'-{last}' if last > first else ''} started again {times} time(s)"
                     for group, first, last, times in runs)


def follow(rd: RunDir, job_id: str) -> int:
    """Print the job's output as it grows until the job ends; 0 if the run finished. Interrupted (Ctrl-C), it
    says that the job goes on and how to reach it (before: `interrupted (SIGINT)`, as if the run had stopped)."""
    from toolkit.progress import Progress

    out = rd.path / "slurm" / f"{job_id}_0_log.out"
    shown, unreachable = 0, False
    progress = Progress()
    try:
        while True:
            job = slurm_job(job_id)
            state = job["state"].split()[0]
            if state == "UNREACHABLE" and not unreachable:  # (said once; it goes on asking)
                print(f"note: {job['state']}; asking again until it does", file=sys.stderr, flush=True)
            unreachable = state == "UNREACHABLE"
            if out.exists():
                text = out.read_text(errors="replace")
                for line in text[shown:text.rfind("\n") + 1].splitlines():
                    progress(line)
                shown = max(shown, text.rfind("\n") + 1)
            if ended(state):
                break
            reason = job["reason"] if state == "PENDING" else ""
            if reason in STUCK:
                progress.close()
                print(f"error: slurm job {job_id} stays pending: {reason} ({STUCK[reason]}); it will not start "
                      f"until that changes. It is left in the queue: see `scontrol show job {job_id}`, release or "
                      f"fix it (scontrol release/update), then follow it with `slurm-rlhf status {rd.path}`; or "
                      f"`slurm-rlhf cancel {rd.path}`", file=sys.stderr, flush=True)
                return 1
            status = rd.read_json(rd.status)
            last = status.get("last_metrics") or {}
            if "step" in last and status.get("steps"):
                key = "reward_mean" if "reward_mean" in last else "loss"
                progress.advance(last["step"] + 1, status["steps"], f"{key.split('_')[0]} {last.get(key, 0):.3f}")
            time.sleep(1)
    except KeyboardInterrupt as e:  # (Ctrl-C, SIGTERM: this process stops following; the job is not touched)
        signum = e.args[0] if e.args and isinstance(e.args[0], int) else signal.SIGINT
        raise Interrupted(f"stopped following ({signal.Signals(signum).name}); slurm job {job_id} keeps running: "
                          f"`slurm-rlhf status {rd.path}` shows it, `slurm-rlhf cancel {rd.path}` stops it",
                          128 + signum) from None
    finally:
        progress.close()
    status = rd.read_json(rd.status)
    if status.get("state") == "finished" and state == "COMPLETED":
        return 0
    print(f"error: slurm job {job_id} ended {state}; run state {status.get('state', 'unknown')}"
          + (f": {status['error']}" if status.get("error") else f" (job output: {out})"), file=sys.stderr)
    return 1


def state_text(rd: RunDir, status: dict) -> str:
    """The run's state as status.json says it, and where it says `starting` or `running` though nothing runs
    it any more (its driver was killed: only a live driver writes the file), that."""
    state = str(status.get("state", "unknown"))
    if state not in ("starting", "running"):
        holder = rd.running_driver()
        if holder.get("pid") and holder["pid"] != status.get("driver", {}).get("pid"):  # (not written by it yet)
            return f"starting again (driver pid {holder['pid']}; its last start ended {state})"
        return state
    if run_going(rd.path):
        return state
    gone = "its Slurm job has ended" if rd.read_json(rd.job).get("job_id") else "its local driver is gone (killed?)"
    return f"{state}, but no driver runs it: {gone}; `slurm-rlhf resume {resume_target(rd.path)}` goes on"


def live_job(rd: RunDir) -> str | None:
    """The run's Slurm job while it is queued or running, in words; None if it has ended (or the run is local,
    or Slurm's commands are not here)."""
    job_id = rd.read_json(rd.job).get("job_id")
    if not job_id or shutil.which("squeue") is None:
        return None
    state = slurm_job(str(job_id))["state"]
    return None if ended(state) else f"slurm job {job_id} is {state}"


def run_going(path: Path) -> str | None:
    """Whether the run in `path` goes on, in words: its local driver holds the directory's lock, or its
    Slurm job is queued or running; None once neither is so."""
    rd = RunDir(path)
    if rd.lock_held():
        pid = rd.lock_holder().get("pid")
        return f"its local driver{f' (pid {pid})' if pid else ''} runs"
    return live_job(rd)


def cancel(rd: RunDir, timeout_s: float = 60) -> str:
    """Cancel the run's Slurm job (or stop its local driver) and wait until it has ended. A local driver that
    runs comes first: a run submitted once and resumed here still names its old job in job.json."""
    job = rd.read_json(rd.job)
    if job.get("job_id") and not rd.lock_held():
        job_id = str(job["job_id"])
        if shutil.which("scancel") is None:
            raise RunError("scancel not found: run `cancel` where Slurm's commands are installed")
        state = slurm_job(job_id)["state"]
        if ended(state):  # (before: "cancelled" of a job that had finished long ago, or that Slurm forgot)
            return f"slurm job {job_id} had already ended ({state}); nothing to cancel"
        answer = _ask(["scancel", job_id])
        if answer.returncode:
            raise RunError(f"scancel {job_id} failed: {answer.stderr.strip() or f'exit status {answer.returncode}'}; "
                           f"try again, or see `squeue -j {job_id}`")
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            state = slurm_job(job_id)["state"]
            if ended(state):
                return f"cancelled slurm job {job_id} ({state})"
            time.sleep(0.5)
        raise RunError(f"slurm job {job_id} still not ended {timeout_s:.0f} s after scancel")
    status = rd.read_json(rd.status)
    driver = rd.running_driver() or status.get("driver", {})
    pid = driver.get("pid")
    if not pid:
        raise RunError(f"{rd.path}: neither a Slurm job nor a running local driver is recorded")
    if driver.get("node") not in (None, node_name()):
        raise RunError(f"the run's driver (pid {pid}) runs on node {driver['node']}, not here ({node_name()}); "
                       "run `slurm-rlhf cancel` there")
    import psutil

    try:
        started = psutil.Process(pid).create_time()
    except psutil.NoSuchProcess:
        return f"the local driver (pid {pid}) had already ended"
    if "started" in driver and abs(started - driver["started"]) > 1.0:  # the pid now belongs to another process
        return (f"the local driver (pid {pid}) had already ended (run state: {status.get('state', 'unknown')}); "
                f"pid {pid} is now another process, left alone")
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return f"the local driver (pid {pid}) had already ended"

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                break
        except psutil.NoSuchProcess:
            break
        time.sleep(0.2)
    else:
        raise RunError(f"the local driver (pid {pid}) did not stop within {timeout_s:.0f} s")
    return f"stopped the local driver (pid {pid}) and its workers"
