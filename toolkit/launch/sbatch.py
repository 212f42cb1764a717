"""The batch script of a run: `#SBATCH` lines from the allocation plan, in the thin sbatch.sh.tmpl beside
this file (package data: it is installed with the package).

One pure function serves `render` (a script you submit by hand), `submit` (the same script carrying
Submitit's command) and `submit --dry-run`; golden tests compare its output with checked-in files.
"""

from __future__ import annotations

import shlex
import string
from pathlib import Path

from toolkit.launch.allocation import Allocation, Component, mem_option

TEMPLATE = Path(__file__).with_name("sbatch.sh.tmpl")

JOB_WIDE = frozenset({"array", "begin", "chdir", "comment", "deadline", "dependency", "error", "export",
                      "export-file", "get-user-env", "hold", "input", "job-name", "kill-on-invalid-dep", "mail-type",
                      "mail-user", "no-requeue", "open-mode", "output", "parsable", "priority", "propagate",
                      "requeue", "signal", "test-only", "wait", "wckey"})
"""sbatch options of the job as a whole (its name, its mail, its dependencies, its batch script's output and
signal): in a heterogeneous job they go in the first component only, where Slurm reads them. Every other
`slurm.sbatch` option (exclusive, reservation, gres, mem-per-cpu, exclude, ...) asks for resources of the
component it is written in, and goes in every component (before, only the first one got them)."""


def job_log(run_dir: str, suffix: str = "out") -> str:
    """The batch script's own output file (%j: the job id), in Submitit's naming."""
    return f"{run_dir}/slurm/%j_0_log.{suffix}"


def sbatch_script(cfg, allocation: Allocation, run_dir: str, command: list[str] | str, how: str,
                  depends_on: str | None = None) -> str:
    """The batch script; `command` is an argv list (quoted here) or a ready shell line. `depends_on`: a
    job that must finish well first (a pipeline's previous stage); if it fails, this one is cancelled."""
    s = cfg.slurm
    common = {"time": s.time_min, "account": s.account, "qos": s.qos}
    # USR1 to the batch shell (the driver) before the time limit: checkpoint, then requeue and resume.
    head = {"job-name": s.job_name or cfg.run.name, "output": job_log(run_dir), "error": job_log(run_dir, "err"),
            "open-mode": "append", "signal": f"B:USR1@{s.signal_lead_s}", "requeue": True,
            **{k: v for k, v in s.sbatch.items() if k in JOB_WIDE}}
    each = {k: v for k, v in s.sbatch.items() if k not in JOB_WIDE}
    if depends_on:
        head.update({"dependency": f"afterok:{depends_on}", "kill-on-invalid-dep": "yes"})
    blocks = []
    for i, component in enumerate(allocation.components):
        options = {**(head if i == 0 else {}), **each, **_resources(component), **common}
        lines = [f"# component {i}: {', '.join(g.name for g in component.groups)}"] if allocation.heterogeneous else []
        lines += [_flag(k, v) for k, v in options.items() if v is not None and v is not False]
        blocks.append("\n".join(lines))
    groups = [g for c in allocation.components for g in c.groups]
    description = f"{cfg.summary}; " + ", ".join(
        f"{g.name}: {g.workers} worker{'s' if g.workers > 1 else ''} on {g.nodes} node{'s' if g.nodes > 1 else ''}"
        for g in groups)
    if isinstance(command, list):
        command = "exec " + " ".join(shlex.quote(str(a)) for a in command)
    return string.Template(TEMPLATE.read_text()).substitute(
        name=cfg.run.name, description=description, how=how, run_dir=run_dir,
        sbatch="\n#SBATCH hetjob\n".join(blocks),
        setup="\n".join(["set -euo pipefail", *s.setup]), command=command)


def _resources(c: Component) -> dict:
    return {"nodes": c.nodes, "ntasks-per-node": c.tasks_per_node, "cpus-per-task": c.cpus_per_task,
            "gpus-per-task": None if c.gpus_per_node else c.gpus_per_task or None, "gpus-per-node": c.gpus_per_node,
            "mem": mem_option(c.mem_gb) if c.mem_gb else None,
            "partition": c.partition, "constraint": c.constraint}


def _flag(key: str, value) -> str:
    if value is True:
        return f"#SBATCH --{key}"
    return f"#SBATCH --{key}={shlex.quote(str(value))}"
