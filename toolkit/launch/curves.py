"""TensorBoard curves of a run: every number of each step's metrics record, beside metrics.jsonl.

Event files go to RUN_DIR/tensorboard; watch a run with `tensorboard --logdir RUN_DIR/tensorboard` (the
viewer is not a dependency: `pip install tensorboard` where you look at them). Tags are the metrics'
names, phase times (`*_s`) under `time/`, reward components under `reward/`. The x-axis is the number
of steps trained, the step's number in the progress line (`step 3/40` is at 3; metrics.jsonl's `step`
counts from 0), so a step's curves stand at the policy version, the checkpoint and the evaluation its
weights make. A resumed run opens a new event file that starts with a purge at the step before its first,
so TensorBoard drops what an earlier attempt wrote from that step on, and writes that step again from
metrics.jsonl (the earlier attempt, killed, may have written it in part): the curves go on with every step
once, as metrics.jsonl has them.

With `wandb.project` set, the same scalars go to Weights & Biases under the same tags: one W&B run per
run directory (its id kept in RUN_DIR/wandb/run-id), continued by every resume. W&B keeps what it is sent
in memory until its run finishes, so an attempt that is killed loses its W&B steps: RUN_DIR/wandb/last-step
records the last step of a W&B run that finished, and the next attempt first sends the steps after it
from metrics.jsonl. Offline mode writes under RUN_DIR/wandb for `wandb sync` later.

A run's own evaluations (eval.every_steps) go to W&B too, as `eval/...` plotted against `eval/step` (the
policy version evaluated), each in the row of the latest training step W&B has (the row of the step
that made those weights, the same number, unless later steps came first, asynchronously); a resume
sends those of the steps it sends again with them. TensorBoard gets them as a run of its own
(`eval-in-run`, use/evaluate.py).
"""

from __future__ import annotations

import importlib
import logging
import math
import os
import secrets
import shutil
import sys
import tempfile
import threading
from pathlib import Path

import yaml

NOT_CURVES = {"step", "time"}
WANDB_FINISH_S = 60.0  # the longest wait for W&B to finish a run (online: its upload, which a stalled network holds)

log = logging.getLogger(__name__)


def import_wandb(staging: Path):
    """The wandb module. As it is imported, wandb makes two staging directories in the temporary directory
    (`tmp*wandb-media`, `tmp*wandb-artifacts`) and removes them as the process exits; a driver killed with
    SIGKILL left them in TMPDIR. They are made in `staging` (RUN_DIR/wandb/tmp) instead, where what an
    attempt killed before left is removed first (the run directory's lock keeps out a second driver)."""
    if "wandb" in sys.modules:
        return sys.modules["wandb"]
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(mode=0o700)
    given = tempfile.tempdir
    tempfile.tempdir = str(staging)
    try:
        import wandb
    finally:
        tempfile.tempdir = given
    return wandb


def summary_writer():
    """tensorboardX's SummaryWriter class, imported without torch where this process has not loaded torch:
    tensorboardX's writer imports torch only to accept torch tensors (it goes on without it), and curves are
    plain numbers. In the driver, torch would cost about 250 MB and a second of start-up for nothing."""
    if "torch" in sys.modules:
        return importlib.import_module("tensorboardX").SummaryWriter
    sys.modules["torch"] = None  # (`import torch` raises ImportError meanwhile, which tensorboardX handles)
    try:
        return importlib.import_module("tensorboardX").SummaryWriter
    finally:
        del sys.modules["torch"]


def tag(name: str) -> str:
    """The TensorBoard tag of metric `name`: seconds (`*_s`) under `time/`, rates (`*_per_s`) not."""
    if "/" in name or name.endswith("_per_s"):
        return name
    return f"time/{name}" if name.endswith("_s") else name


def scalars(record: dict) -> dict[str, float]:
    """{tag: value} of the finite numbers of a metrics record."""
    return {tag(name): value for name, value in record.items()
            if name not in NOT_CURVES and not isinstance(value, bool) and isinstance(value, (int, float))
            and math.isfinite(value)}


def eval_scalars(record: dict) -> dict[str, float]:
    """{eval/<name>: value} of an evaluation's summary line (use/evaluate.py): its rewards, length and
    finished share; the x-axis of their curves is `eval/step`, the policy version evaluated."""
    return {f"eval/{name}": value for name, value in record.items()
            if (name.startswith("reward") or name in ("response_len_mean", "finished_frac"))
            and isinstance(value, (int, float)) and math.isfinite(value)}


class Curves:
    """Writes the scalars of metrics records, in step order, to one event file per attempt of a run (and
    to W&B when the config says so)."""

    def __init__(self, run_dir: Path, cfg=None):
        self.run_dir = Path(run_dir)
        self.directory = self.run_dir / "tensorboard"
        self.writer = None
        self.cfg = cfg
        self.wandb = cfg.wandb if cfg is not None and cfg.wandb.project else None
        self.wandb_run = None
        self.wandb_last = -1
        self.wandb_logged = False  # whether this attempt's W&B run has a row at wandb_last (it may add to it)
        self.wandb_caught_up = False

    def open(self) -> None:
        """Start what is slow to start before the workers do. W&B's import, service process and login take
        seconds (more on a busy node or a slow network); at the first step they held the driver's event
        loop, and workers that hear no answer to their heartbeats for transport.heartbeat_timeout_s take
        the driver for dead (a busy machine did that within the 4 s a test allows)."""
        summary_writer()  # (its import too, once, here)

        if self.wandb is not None and self.wandb_run is None:
            self._start_wandb()

    def add(self, record: dict) -> None:
        step = int(record["step"]) + 1  # (steps trained: see the module docstring)
        if self.writer is None:
            self._open_writer(step)
        values = scalars(record)
        self._write(step, values, record.get("time"))
        if self.wandb is not None:
            self._to_wandb(step, values)

    def _open_writer(self, step: int) -> None:
        """This attempt's event file, which rewrites the curves from the step before its first (`step`) on
        (purge): that step's record, the newest metrics.jsonl keeps from an earlier attempt, is written again.
        tensorboardX writes events from a queue in a thread of its own and its flush() does not wait for them,
        so a driver killed after a step's record (SIGKILL, a lost node) lost that step's curves, in part or
        whole, while metrics.jsonl had it; and a kill between the record and its curves did too."""
        from toolkit.store.manifest import read_jsonl

        before = [r for r in read_jsonl(self.run_dir / "metrics.jsonl") if int(r.get("step", -1)) + 1 < step]
        again = max(before, key=lambda r: r["step"]) if before else None
        purge = int(again["step"]) + 1 if again else step
        self.writer = summary_writer()(str(self.directory), purge_step=purge, flush_secs=30)
        if again is not None:
            self._write(purge, scalars(again), again.get("time"))

    def _write(self, step: int, values: dict[str, float], walltime: float | None) -> None:
        for name, value in values.items():
            self.writer.add_scalar(name, value, step, walltime=walltime)
        self.writer.flush()

    def add_evaluation(self, record: dict) -> None:
        """An in-run evaluation's summary line, to W&B (see the module docstring)."""
        if self.wandb is not None:
            self._to_wandb(None, {"eval/step": record["step"], **eval_scalars(record)})

    def _start_wandb(self) -> None:
        directory = self.run_dir / "wandb"
        last_file = directory / "last-step"
        self.wandb_last = int(last_file.read_text()) if last_file.exists() else -1
        os.environ.setdefault("WANDB_SILENT", "true")  # (its notes would mix with the run's lines)
        directory.mkdir(mode=0o700, exist_ok=True)
        wandb = import_wandb(directory / "tmp")

        from toolkit.config import dump_config

        id_file = directory / "run-id"
        if not id_file.exists():
            id_file.write_text(secrets.token_hex(4))
        w = self.wandb
        self.wandb_run = wandb.init(project=w.project, entity=w.entity, mode=w.mode, tags=w.tags or None,
                                    name=self.cfg.run.name, id=id_file.read_text().strip(), resume="allow",
                                    dir=str(self.run_dir), config=yaml.safe_load(dump_config(self.cfg)),
                                    # (W&B's own waits for its upload, at finish() and in its exit hook, end
                                    # too; finish() then raises, and last-step stays where it was)
                                    settings=wandb.Settings(console="off", x_disable_stats=True, disable_git=True,
                                                            finish_timeout=WANDB_FINISH_S, finish_timeout_raises=True))
        self.wandb_run.define_metric("eval/step")
        self.wandb_run.define_metric("eval/*", step_metric="eval/step")

    def _to_wandb(self, step: int | None, values: dict) -> None:
        """`values` at W&B step `step`, or (None: an evaluation) in the latest row this W&B run has, or the
        next one."""
        if self.wandb_run is None:
            self._start_wandb()
        if not self.wandb_caught_up:
            from toolkit.store.manifest import read_jsonl
            from toolkit.use.evaluate import in_run_evaluations

            # what an attempt killed before its W&B run finished had sent (the newest record of each step),
            # with the evaluations of the weights those steps made
            missed = {r["step"] + 1: scalars(r) for r in read_jsonl(self.run_dir / "metrics.jsonl")
                      if self.wandb_last < r["step"] + 1 and (step is None or r["step"] + 1 < step)}
            for e in in_run_evaluations(self.run_dir):
                if e["step"] in missed:
                    missed[e["step"]].update({"eval/step": e["step"], **eval_scalars(e)})
            for s in sorted(missed):
                self.wandb_run.log(missed[s], step=s)
                self.wandb_last, self.wandb_logged = s, True
            self.wandb_caught_up = True
        if step is None:  # (a row that a finished W&B run has is closed to more: the next one then)
            step = self.wandb_last if self.wandb_logged else self.wandb_last + 1
        if step > self.wandb_last or (step == self.wandb_last and self.wandb_logged):
            self.wandb_run.log(values, step=step)
            self.wandb_last, self.wandb_logged = step, True

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
        if self.wandb_run is not None:
            run, self.wandb_run, self.wandb_caught_up = self.wandb_run, None, False
            if _finished(run, WANDB_FINISH_S):  # (W&B writes, or uploads, what it holds)
                (self.run_dir / "wandb" / "last-step").write_text(str(self.wandb_last))


def _finished(run, timeout_s: float) -> bool:
    """Whether the W&B `run` finished within `timeout_s`; else, or if it failed, the next attempt sends the
    steps after RUN_DIR/wandb/last-step again, and the driver goes on (to its exit, or to its requeue before
    the job's time is up). W&B bounds its upload itself (`finish_timeout`); the thread bounds the call where
    W&B's service does not answer at all."""
    failed = []

    def finish():
        try:
            run.finish()
        except Exception as e:  # (a network error of W&B's own; the run's files are whole without it)
            failed.append(e)

    worker = threading.Thread(target=finish, name="wandb-finish", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive() or failed:
        log.warning("W&B did not finish the run (%s); its steps from RUN_DIR/wandb/last-step on are sent again at "
                    "the next resume", f"{failed[0]!r}" if failed else f"still busy after {timeout_s:.0f} s")
        return False
    return True
