"""A pipeline's stages, run in order: here one after the other, or on Slurm as one job per stage chained
with `--dependency=afterok:<previous job>` (a stage starts only once the one before it finished well and
wrote its export) and `--kill-on-invalid-dep=yes` (a failed stage cancels the ones after it).

    PIPELINE_DIR/pipeline.json      the pipeline's name, file, stages and the --set overrides it was started with
    PIPELINE_DIR/<stage>/           each stage's run directory (config.yaml, job.json, export/, ...)
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import time
from pathlib import Path

from toolkit.errors import ConfigError, Interrupted, RunError, ToolkitError
from toolkit.launch.rundir import RunDir
from toolkit.newdir import check_new
from toolkit.table import text_table


class PipelineDir:
    def __init__(self, path: str | os.PathLike):
        self.path = Path(path).resolve()
        self.file = self.path / "pipeline.json"

    def stage(self, name: str) -> RunDir:
        return RunDir(self.path / name)

    def stages(self) -> list[str]:
        return json.loads(self.file.read_text())["stages"]

    def source(self) -> str:
        """The pipeline file it was made from (resume reads it again)."""
        return json.loads(self.file.read_text())["source"]

    def overrides(self) -> tuple[list[str], str | None]:
        """The `--set` overrides it was started with, and the folder they were given in (their relative
        paths are relative to it): resume applies them again (none in a directory of an earlier version)."""
        made = json.loads(self.file.read_text())
        return made.get("overrides", []), made.get("cwd")

    def create(self, pipeline, overrides: list[str] = ()) -> "PipelineDir":
        if self.file.exists():
            raise ConfigError(f"{self.path} already holds a pipeline; choose another --run-dir, remove it, or "
                              f"continue it with: slurm-rlhf resume {shlex.quote(str(self.path))}")
        check_new(self.path, f"--run-dir {self.path}", "pipeline")
        os.umask(0o077)
        self.path.mkdir(parents=True, exist_ok=True)
        self.path.chmod(0o700)
        RunDir.write_atomic(self.file, json.dumps({"name": pipeline.name, "source": str(pipeline.source.resolve()),
                                                   "stages": list(pipeline.stages), "overrides": list(overrides),
                                                   "cwd": os.getcwd()}, indent=1))
        return self


def is_pipeline_dir(path: str | os.PathLike) -> bool:
    return (Path(path) / "pipeline.json").exists()


def resume_target(run_dir: str | os.PathLike) -> str:
    """What to give `slurm-rlhf resume` to continue the run in `run_dir`: its pipeline's directory when it is
    a stage of one (the stages after it then run too), else itself; quoted for a shell."""
    path = Path(run_dir)
    return shlex.quote(str(path.parent if is_pipeline_dir(path.parent) else path))


def stage_dirs(path: str | os.PathLike) -> list[Path]:
    """The run directories of a pipeline directory's stages."""
    return sorted(p for p in Path(path).iterdir() if (p / "config.yaml").exists())


def refuse_pipeline_dir(path: str | os.PathLike, verb: str) -> None:
    """ConfigError when `path` is a pipeline directory, naming its stages: the user is to `verb` one of them."""
    if is_pipeline_dir(path):
        raise ConfigError(f"{path} is a pipeline directory; {verb} one of its stages: "
                          + ", ".join(map(str, stage_dirs(path))))


def finished(rd: RunDir) -> bool:
    """The stage ran to its end and wrote its export."""
    return rd.read_json(rd.status).get("state") == "finished" and (rd.path / "export").is_dir()


def started(rd: RunDir) -> bool:
    """The stage's driver ran (its manifest has records). A stage submitted to Slurm whose job never ran (an
    earlier stage failed, or it was cancelled) has only its config.yaml."""
    from toolkit.store.manifest import Manifest

    return rd.config.exists() and bool(Manifest(rd.path).records())


def write_config(rd: RunDir, cfg) -> None:
    """The config.yaml of a stage that has not started, as the pipeline file says now: a stage submitted before
    but never run kept the config.yaml of its submission, and ran with settings the file no longer gave."""
    from toolkit.config import dump_config

    if rd.config.exists():
        rd.write_atomic(rd.config, dump_config(cfg))
    else:
        rd.create(cfg)


def check_started(configs: list, pd: PipelineDir) -> None:
    """Before a resume, of each stage that started: the pipeline file's settings that it does not follow
    (it keeps those of its config.yaml), said; and a ConfigError if an earlier stage's export it started
    from was written again since (its results come from the model before)."""
    from toolkit.config import load_config
    from toolkit.store.manifest import Manifest

    split_of, waiting = {}, []  # (the split each started stage keeps; the stages not started yet)
    for i, cfg in enumerate(configs):
        rd = pd.stage(cfg.stage)
        records = Manifest(rd.path).records() if rd.config.exists() else []
        if not records:  # (not started: submitted to Slurm, its config.yaml may name an export not written yet)
            waiting.append(cfg)
            continue
        kept = load_config(rd.config)
        split_of[cfg.stage] = _split(kept)
        fields = _differences(_flat(cfg.model_dump(mode="json")), _flat(kept.model_dump(mode="json")))
        # (a finished stage is not run again: an edit of its config.yaml changes nothing in the pipeline)
        fix = ("it finished, and is not run again: to run the pipeline with them, start it anew in another "
               "--run-dir" if finished(rd) else f"to change them, edit {rd.config}")
        if fields:
            print(f"pipeline: stage {cfg.stage} keeps the settings it started with ({rd.config}); the pipeline file "
                  f"now says otherwise for {', '.join(fields[:6])}{' ...' if len(fields) > 6 else ''} ({fix})",
                  flush=True)
        text = rd.config.read_text()
        for earlier in configs[:i]:
            export = pd.stage(earlier.stage).path / "export"
            last = Manifest(export.parent).last("export")
            if str(export) in text and last is not None and last["time"] > records[0]["time"]:
                raise ConfigError(f"stage {cfg.stage} started from {export} before stage {earlier.stage} exported "
                                  f"again (step {last['step']}), so its results come from the model before; move "
                                  f"{rd.path} and the stages after it aside to run them again from the new export, "
                                  f"then resume")
    # A stage not started yet takes the pipeline file's split as it is now; one that started keeps its own. A
    # split changed between them gave the later stages rows (prompts) an earlier stage trained on, silently.
    for cfg in waiting:
        for stage, kept in split_of.items():
            if _split(cfg) != kept:
                raise ConfigError(f"{pd.source()}: data.split is {_split(cfg)} now, but stage {stage} started with "
                                  f"{kept} ({pd.stage(stage).config}); a pipeline splits its rows once for every "
                                  f"stage, and stage {cfg.stage} would train on rows of stage {stage}'s part: put "
                                  f"data.split back as it was, or run the pipeline anew in another --run-dir")


def _split(cfg) -> dict | None:
    """The stage's data.split, as its config gives it."""
    return cfg.data.split.model_dump(mode="json") if cfg.data.split is not None else None


def _flat(value, prefix: str = "") -> dict:
    if isinstance(value, dict):
        return {k: v for key, item in value.items() for k, v in _flat(item, f"{prefix}{key}.").items()}
    return {prefix.rstrip("."): value}


def _differences(a: dict, b: dict) -> list[str]:
    return sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))


def run_pipeline_here(configs: list, pd: PipelineDir, verbose: bool) -> int:
    """Run the stages in order on this machine (a finished stage is skipped, a started one resumed)."""
    from toolkit.config import load_config
    from toolkit.launch.here import run_here

    for cfg in configs:
        rd = pd.stage(cfg.stage)
        if finished(rd):
            print(f"pipeline: {cfg.stage} finished before; its model is {rd.path / 'export'}", flush=True)
            continue
        if started(rd):
            cfg = load_config(rd.config)  # (a stage that started before: resume it as it was)
        else:
            write_config(rd, cfg)
        print(f"pipeline: stage {cfg.stage}", flush=True)
        try:
            code = run_here(cfg, rd, verbose)
        except RunError as e:  # (the pipeline goes on from its directory: a resume of the stage's ends with it)
            again = "" if "slurm-rlhf resume" in str(e) else \
                f"\ncontinue the pipeline with: slurm-rlhf resume {shlex.quote(str(pd.path))}"
            raise RunError(f"pipeline stopped: stage {cfg.stage} failed ({rd.path}): {e}{again}") from None
        except Interrupted as e:
            raise Interrupted(f"{e} (pipeline stage {cfg.stage}, {rd.path}); continue the pipeline with: "
                              f"slurm-rlhf resume {shlex.quote(str(pd.path))}", e.exit_code) from None
        if code != 0 or not finished(rd):
            print(f"pipeline stopped after stage {cfg.stage} (state {rd.read_json(rd.status).get('state')}); continue "
                  f"with: slurm-rlhf resume {shlex.quote(str(pd.path))}", flush=True)
            return code
    print(f"pipeline done: {', '.join(cfg.stage for cfg in configs)}; the last model is "
          f"{pd.stage(configs[-1].stage).path / 'export'}", flush=True)
    return 0


def pipeline_jobs(configs: list, pd: PipelineDir) -> list[tuple]:
    """[(config, allocation)] of each stage not finished yet, every one checked against the partitions before
    any is submitted (a later stage's job that Slurm would keep waiting is named while nothing runs)."""
    from toolkit.config import load_config
    from toolkit.launch.allocation import plan_allocation
    from toolkit.launch.submit import check_partitions
    from toolkit.placement.plan import plan

    # (a stage that started runs its config.yaml: its job is sized, timed and placed from that, not from the
    # pipeline file's settings it does not follow)
    configs = [load_config(pd.stage(cfg.stage).config) if started(pd.stage(cfg.stage)) else cfg for cfg in configs]
    todo = [(cfg, plan_allocation(plan(cfg), cfg.slurm.heterogeneous)) for cfg in configs
            if not finished(pd.stage(cfg.stage))]
    for cfg, allocation in todo:
        try:
            check_partitions(allocation, cfg.slurm.partition)
        except ConfigError as e:
            raise ConfigError(f"stage {cfg.stage}: {e}") from None
    return todo


def submit_pipeline(todo: list[tuple], pd: PipelineDir) -> list[tuple[str, str]]:
    """Submit one job per stage of `todo` (pipeline_jobs), each depending on the one before; [(stage, job id)].
    All or none: when sbatch refuses a stage, the stages submitted before it are cancelled (none runs without
    the stages after it), and the error names the stage."""
    from toolkit.launch.jobs import cancel
    from toolkit.launch.submit import submit

    jobs, previous = [], None
    for cfg, allocation in todo:
        rd = pd.stage(cfg.stage)
        if not started(rd):
            write_config(rd, cfg)
        try:
            job_id = submit(cfg, allocation, rd, depends_on=previous)
        except ToolkitError as e:
            cancelled, failed = [], []
            for stage, job in reversed(jobs):
                try:
                    cancel(pd.stage(stage))
                    cancelled.insert(0, f"{stage} (job {job})")
                except (ToolkitError, OSError, subprocess.SubprocessError) as c:
                    failed.insert(0, f"\nstage {stage}'s job {job} could not be cancelled ({c}): scancel {job}")
            undone = f"\ncancelled the stages submitted before it, so that none of the pipeline runs: " \
                     f"{', '.join(cancelled)}" if cancelled else ""
            raise (ConfigError if isinstance(e, ConfigError) else RunError)(
                f"stage {cfg.stage}: {e}{undone}{''.join(failed)}") from None
        rd.update_job(job_id=job_id, submitted=time.time(), requeues=0, depends_on=previous)
        jobs.append((cfg.stage, job_id))
        previous = job_id
    return jobs


def follow_pipeline(pd: PipelineDir, jobs: list[tuple[str, str]]) -> int:
    """Follow each stage's job in turn; 0 if every stage finished. A failed stage is named with its
    cause, and the stages after it are cancelled (Slurm does it too: --kill-on-invalid-dep)."""
    from toolkit.launch.jobs import follow

    for i, (stage, job_id) in enumerate(jobs):
        print(f"pipeline: stage {stage}, slurm job {job_id}", flush=True)
        if follow(pd.stage(stage), job_id) != 0:
            later = [j for _, j in jobs[i + 1:]]
            if later:
                subprocess.run(["scancel", *later], capture_output=True, timeout=30)
            print(f"error: pipeline stopped: stage {stage} (slurm job {job_id}) did not finish"
                  + (f"; cancelled {', '.join(f'{s} (job {j})' for s, j in jobs[i + 1:])}" if later else ""),
                  flush=True)
            return 1
    print(f"pipeline done; the last model is {pd.stage(jobs[-1][0]).path / 'export'}", flush=True)
    return 0


def pipeline_status(pd: PipelineDir) -> str:
    """A table of the stages: Slurm job and state, run state, steps, and what went wrong. Only a live driver
    writes a stage's state: a stage that says `starting` or `running` though nothing runs it (its driver was
    killed, its Slurm job ended) is said to be so, as `status` of the stage says (it stayed `running`)."""
    from toolkit.launch.jobs import run_going, slurm_job

    rows = [("stage", "slurm job", "slurm state", "run state", "steps", "note")]
    failed, errors = None, []
    for stage in pd.stages():
        rd = pd.stage(stage)
        job = rd.read_json(rd.job) if rd.path.exists() else {}
        status = rd.read_json(rd.status) if rd.path.exists() else {}
        state = slurm_job(str(job["job_id"])) if job.get("job_id") else {}
        run_state = status.get("state", "not started")
        steps = f"{status.get('step', -1) + 1}/{status['steps']}" if status.get("steps") else "-"
        note = ""
        if status.get("error"):
            note = "failed: see below"
            errors.append(f"{stage}: " + "\n    ".join(status["error"].splitlines()[:4]))
            failed = failed or stage
        elif run_state in ("starting", "running") and not run_going(rd.path):
            gone = "its Slurm job has ended" if job.get("job_id") else "its local driver is gone (killed?)"
            note = f"no driver runs it: {gone}; `slurm-rlhf resume {resume_target(rd.path)}` goes on"
        elif state.get("reason") == "DependencyNeverSatisfied" or (failed and run_state == "not started"):
            note = f"not run: {failed or 'an earlier stage'} did not finish"
        elif run_state == "finished" and (rd.path / "export").is_dir():
            note = f"model: {rd.path / 'export'}"
        elif state.get("state") == "PENDING" and job.get("depends_on"):
            note = f"waits for job {job['depends_on']}"
        rows.append((stage, str(job.get("job_id", "-")), state.get("state", "-").split()[0] if state else "-",
                     run_state, steps, note))
    name = json.loads(pd.file.read_text())["name"]
    return "\n".join([f"pipeline {name!r} in {pd.path}", text_table(rows), *errors])


def cancel_pipeline(pd: PipelineDir) -> str:
    """Cancel every stage's job (or stop the stage running here)."""
    from toolkit.launch.jobs import cancel

    lines = []
    for stage in pd.stages():
        rd = pd.stage(stage)
        if not rd.config.exists():
            continue
        status = rd.read_json(rd.status)
        job = rd.read_json(rd.job)
        if job.get("job_id") or status.get("state") in ("starting", "running"):
            try:
                lines.append(f"{stage}: {cancel(rd)}")
            except RunError as e:
                lines.append(f"{stage}: {e}")
    return "\n".join(lines) or "nothing to cancel"
