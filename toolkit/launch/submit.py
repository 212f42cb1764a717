"""`slurm-rlhf submit`: one Slurm allocation, sized from the placement, submitted through Submitit.

Submitit pickles the call `run_in_allocation(RUN_DIR)` into RUN_DIR/slurm (our own file on our own
file system, never sent over a network), submits, and tracks the job. The batch script is ours
(`sbatch_script`), so it is the same text `render` writes and `--dry-run` prints, and it can describe
a heterogeneous job, which Submitit's own script cannot.
"""

from __future__ import annotations

import contextlib
import io
import shlex
import subprocess
import sys

from toolkit.errors import ConfigError, RunError, ToolkitError
from toolkit.launch.allocation import Allocation
from toolkit.launch.sbatch import sbatch_script


def submitit_command(python: str, folder: str) -> str:
    return ("export SUBMITIT_EXECUTOR=slurm\n"
            f"exec {shlex.quote(python)} -u -m submitit.core._submit {shlex.quote(folder)}")


def submit_script(cfg, allocation: Allocation, run_dir: str, depends_on: str | None = None) -> str:
    """The script `submit` hands to sbatch for a run directory (printed by --dry-run)."""
    python = cfg.slurm.python or sys.executable
    return sbatch_script(cfg, allocation, run_dir, submitit_command(python, f"{run_dir}/slurm"), how="submit",
                         depends_on=depends_on)


def partitions() -> tuple[dict[str, int], str | None]:
    """({partition: nodes}, the default partition) as `sinfo` shows them (hidden ones too: -a); ({}, None)
    where `sinfo` is not here or fails."""
    try:
        out = subprocess.run(["sinfo", "-h", "-a", "-s", "-o", "%P %F"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return {}, None
    sizes, default = {}, None
    for line in out.stdout.splitlines() if out.returncode == 0 else []:
        name, _, counts = line.strip().partition(" ")  # (counts: allocated/idle/other/total)
        total = counts.split("/")[-1]
        if total.isdigit():
            if name.endswith("*"):
                name = default = name[:-1]
            sizes[name] = int(total)
    return sizes, default


def check_partitions(allocation: Allocation, slurm_partition: str | None = None) -> None:
    """A job that asks for a partition that does not exist (sbatch's "invalid partition name specified",
    after the run directory is made) or for more nodes than a partition has, which Slurm may queue and never
    start (PartitionNodeLimit), is a ConfigError before it is submitted. `slurm_partition`: the config's
    slurm.partition, to name the setting to fix."""
    sizes, default = partitions()
    need: dict[str | None, int] = {}
    for component in allocation.components:
        name = component.partition or default
        need[name] = need.get(name, 0) + component.nodes
        if sizes and name is not None and name not in sizes:
            fields = sorted({"slurm.partition" if g.partition == slurm_partition else f"placement.{g.name}.partition"
                             for g in component.groups})
            listed = ", ".join(f"{p}{' (default)' if p == default else ''}" for p in sizes)
            raise ConfigError(f"{' and '.join(fields)}: there is no partition {name!r} on this cluster (sinfo "
                              f"lists {listed}); name one of those")
    for name, nodes in need.items():
        have = sizes.get(name)
        if have is not None and nodes > have:
            raise ConfigError(f"the job needs {nodes} nodes in partition {name}, which has {have} (sinfo): Slurm "
                              "would keep it waiting (PartitionNodeLimit); give the node groups fewer nodes "
                              "(placement.<group>.nodes) or a larger partition (slurm.partition, "
                              "placement.<group>.partition)")


def submit(cfg, allocation: Allocation, run_dir, depends_on: str | None = None) -> str:
    """Submit the run in `run_dir` (already created), after job `depends_on` if given; the Slurm job id."""
    import submitit

    check_partitions(allocation, cfg.slurm.partition)
    script = submit_script(cfg, allocation, str(run_dir.path), depends_on)

    class Executor(submitit.SlurmExecutor):
        def _make_submission_file_text(self, command: str, uid: str) -> str:
            return script

    executor = Executor(folder=run_dir.path / "slurm", python=shlex.quote(cfg.slurm.python or sys.executable))
    executor.update_parameters(time=cfg.slurm.time_min)
    try:
        # (Submitit prints sbatch's stderr when sbatch fails; the error below quotes it, so it is said once)
        with contextlib.redirect_stderr(io.StringIO()):
            job = executor.submit(in_allocation, str(run_dir.path))
    except (submitit.core.utils.FailedJobError, submitit.core.utils.FailedSubmissionError) as e:
        detail = str(e).strip()
        hint = ("\nthe Slurm controller did not answer: check that it runs (`sinfo`, `scontrol ping`) and that "
                "SLURM_CONF names this cluster's slurm.conf" if "contact slurm controller" in detail
                or "configuration file" in detail else "")
        raise RunError(f"sbatch refused the job:\n{detail}{hint}") from None
    return str(job.job_id)


def in_allocation(run_dir: str) -> None:
    """What the job runs (through Submitit): the driver, with errors printed to the job's output."""
    from toolkit.launch.batch import run_in_allocation

    try:
        run_in_allocation(run_dir)
    except ToolkitError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        raise
