"""The driver inside a Slurm allocation, for a run directory made by `submit` or `render`.

`python -m toolkit.launch.batch RUN_DIR` is the command of a rendered sbatch script; `submit` runs
`run_in_allocation(RUN_DIR)` through Submitit. Both start the same Driver as `slurm-rlhf run`, with the
Slurm launcher: one srun step per node group.
"""

from __future__ import annotations

import logging
import os
import sys

from toolkit.errors import RunError, ToolkitError


def run_in_allocation(run_dir: str) -> None:
    from toolkit.config import load_config
    from toolkit.launch.allocation import plan_allocation
    from toolkit.launch.driver import Driver
    from toolkit.launch.env import node_address, node_name
    from toolkit.launch.rundir import RunDir
    from toolkit.launch.slurm import SlurmLauncher
    from toolkit.log import setup_logging
    from toolkit.placement.plan import plan

    os.umask(0o077)
    if "SLURM_JOB_ID" not in os.environ:
        raise RunError("not inside a Slurm allocation (SLURM_JOB_ID is unset): submit the script that "
                       "`slurm-rlhf render` wrote with sbatch, or use `slurm-rlhf submit`")
    rd = RunDir(run_dir)
    setup_logging("driver", level=logging.WARNING, stream=sys.stdout, file=str(rd.logs / "driver.log"))
    cfg = load_config(rd.config)
    rd.update_job(job_id=os.environ.get("SLURM_JOB_ID"), batch_node=node_name(), driver_pid=os.getpid())
    launcher = SlurmLauncher(rd, plan_allocation(plan(cfg), cfg.slurm.heterogeneous), cfg.slurm.python or sys.executable)
    print(f"job {launcher.job_id}: run {cfg.run.name!r} in {rd.path}; node groups: "
          + ", ".join(f"{g} on {','.join(n)}" for g, n in launcher.nodes.items()), flush=True)
    records = Driver(cfg, rd, launcher, node_address(), echo=lambda line: print(line, flush=True)).run()
    print(f"done: {len(records)} steps; metrics in {rd.metrics}", flush=True)


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
