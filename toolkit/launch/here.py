"""Running one stage on this machine: its driver with the local launcher, the progress lines, and the
closing line (what `slurm-rlhf run`, `sft`, `rm` and a local `resume` print)."""

from __future__ import annotations

import logging
import shlex
import time

from toolkit.launch.rundir import RunDir


def run_here(cfg, run_dir: RunDir, verbose: bool = False) -> int:
    """Run (or resume) `run_dir` with local worker processes; the exit code."""
    from toolkit.launch.env import resolve_bind_host
    from toolkit.launch.local import LocalLauncher
    from toolkit.launch.supervisor import make_driver, run_attempts
    from toolkit.log import setup_logging
    from toolkit.progress import Progress, elapsed

    run_dir.hold_lock()  # (before anything is written: a second driver of the directory stops here)
    setup_logging("driver", level=logging.DEBUG if verbose else logging.WARNING, file=str(run_dir.logs / "driver.log"))
    kind = "run" if cfg.stage == "rl" else f"{cfg.stage} run"
    print(f"{kind} {cfg.run.name!r} ({cfg.summary}) in {run_dir.path}", flush=True)
    started = time.monotonic()
    bind_host = resolve_bind_host(cfg.transport.bind_host) if cfg.transport.bind_host else "127.0.0.1"
    progress = Progress()
    try:
        driver, records = run_attempts(
            cfg, lambda: make_driver(cfg, run_dir, LocalLauncher(run_dir, bind_host), bind_host, echo=progress), progress)
    finally:
        progress.close()
    if driver.state == "preempted":
        print(f"stopped at step {driver.step + 1}/{driver.steps}; continue with: slurm-rlhf resume "
              f"{shlex.quote(str(run_dir.path))}", flush=True)
        return 0
    print(f"done in {elapsed(time.monotonic() - started)}: {driver.steps} steps{closing(cfg, records)}; metrics in "
          f"{run_dir.metrics}" + (f"; model in {run_dir.path / 'export'}" if (run_dir.path / "export").exists() else ""),
          flush=True)
    return 0


def closing(cfg, records: list[dict]) -> str:
    """What the stage's steps run now achieved, in a few words."""
    if not records:
        return ""
    first, last = records[: min(5, len(records))], records[-min(5, len(records)):]
    mean = lambda rs, key: sum(r[key] for r in rs) / len(rs)  # noqa: E731
    if cfg.stage == "rl":
        return (f", mean reward of the first {len(first)} steps run now {mean(first, 'reward_mean'):.3f}, of the last "
                f"{len(last)} {mean(last, 'reward_mean'):.3f}")
    evals = [r for r in records if "eval_loss" in r]
    text = f", train loss {records[0]['loss']:.4f} -> {records[-1]['loss']:.4f}"
    if evals:
        text += f", eval loss {evals[0]['eval_loss']:.4f} -> {evals[-1]['eval_loss']:.4f}"
        if "eval_accuracy" in evals[-1]:
            text += f", eval accuracy {evals[-1]['eval_accuracy']:.3f}"
    return text
