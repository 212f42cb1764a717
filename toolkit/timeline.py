"""Every worker's phases over time: RUN_DIR/timeline/<worker>.jsonl, one line per phase change
({"t": unix time, "phase": ..., "step": ...}), what `slurm-rlhf report` draws as who waits for whom.

`PhaseLog` is the status dict a worker's heartbeat carries (phase, step, ...); setting its phase also
appends the line. The file is appended to across resumes (times are wall-clock), readable by its owner only.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path


def timeline_file(run_dir: Path, worker_id: str) -> Path:
    return Path(run_dir) / "timeline" / f"{worker_id.replace(':', '-')}.jsonl"


def _open(path: Path):
    """The timeline file for appending, line-buffered (each line written at once), the owner's alone."""
    path.parent.mkdir(exist_ok=True)
    return os.fdopen(os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600), "a", buffering=1)


def _line(phase, step) -> str:
    return json.dumps({"t": round(time.time(), 4), "phase": phase, "step": step}) + "\n"


class PhaseLog(dict):
    def __init__(self, path: Path):
        super().__init__()
        self._file = _open(path)
        self._last: tuple | None = None

    def __setitem__(self, key, value) -> None:
        super().__setitem__(key, value)
        if key == "phase":
            self._mark()

    def update(self, *args, **kwargs) -> None:
        super().update(*args, **kwargs)
        if "phase" in kwargs or (args and "phase" in args[0]):
            self._mark()

    def _mark(self) -> None:
        now = (self.get("phase"), self.get("step"))
        if now != self._last and not self._file.closed:
            self._last = now
            self._file.write(_line(*now))

    def close(self) -> None:
        self._file.close()


def mark_restart(run_dir: Path, worker_id: str) -> None:
    """The driver's line in a worker's timeline when it starts the worker again: from then until the new
    process registers, the worker is down (without it the phase it died in would be drawn up to then)."""
    with _open(timeline_file(run_dir, worker_id)) as f:
        f.write(_line("restarting", None))


def read_timelines(run_dir: Path) -> dict[str, list[dict]]:
    """{worker file name: its phase changes in order} (a line cut short by a crash is skipped)."""
    from toolkit.store.manifest import read_jsonl

    return {path.stem: read_jsonl(path) for path in sorted((Path(run_dir) / "timeline").glob("*.jsonl"))}
