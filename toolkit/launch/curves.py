"""TensorBoard curves of a run: every number of each step's metrics record, beside metrics.jsonl.

Event files go to RUN_DIR/tensorboard; watch a run with `tensorboard --logdir RUN_DIR/tensorboard` (the
viewer is not a dependency: `pip install tensorboard` where you look at them). Tags are the metrics'
names, phase times (`*_s`) under `time/`, reward components under `reward/`. A resumed run opens a new
event file that starts with a purge at its first step, so TensorBoard drops what an earlier attempt
wrote from that step on: the curves go on with no step twice, as metrics.jsonl does.
"""

from __future__ import annotations

import math
from pathlib import Path

NOT_CURVES = {"step", "time"}


def tag(name: str) -> str:
    """The TensorBoard tag of metric `name`."""
    if "/" in name:
        return name
    return f"time/{name}" if name.endswith("_s") else name


class Curves:
    """Writes the scalars of metrics records, in step order, to one event file per attempt of a run."""

    def __init__(self, directory: Path):
        self.directory = Path(directory)
        self.writer = None

    def add(self, record: dict) -> None:
        from tensorboardX import SummaryWriter

        step = int(record["step"])
        if self.writer is None:  # (purge: this attempt rewrites the curves from its first step on)
            self.writer = SummaryWriter(str(self.directory), purge_step=step, flush_secs=30)
        for name, value in record.items():
            if name in NOT_CURVES or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            if math.isfinite(value):
                self.writer.add_scalar(tag(name), value, step, walltime=record.get("time"))
        self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
