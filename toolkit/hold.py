"""A test hook: stop a run's process at a named moment until it is signalled.

With SLURM_RLHF_TEST_HOLD=<moment> in the environment of `slurm-rlhf run`, the first process of the run
that reaches that moment writes `RUN_DIR/held-<moment>` (its pid) and then waits there, as a process
busy in that phase would, until a signal ends it or the test deletes the file (then it goes on).
`<moment>@N`: the N-th time a process reaches it (`training@7`: in the seventh training step, after
six whole ones). Different moments, comma-separated (`generating@3,scoring@5`), are each held once.
Tests use it to stop a run at each moment (start-up, registration, model loading, generation, scoring,
training, weight sync, checkpoint writing) by waiting for the file, never by sleeping a fixed time.
Without the variable it does nothing.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

ENV = "SLURM_RLHF_TEST_HOLD"
MOMENTS = ("start-up", "registered", "loading", "generating", "scoring", "training", "syncing", "checkpointing",
           "boundary",  # a supervised stage's rank 0 between two steps
           "rejoining",  # a generator started again, between asking for its new weight-sync group and joining it
           "evaluating",  # a generator given the held-out prompts of an evaluation (eval.every_steps)
           "re-registering")  # a worker started again (told where to listen), before it registers


_reached: dict[str, int] = {}


def held_file(run_dir, hold: str) -> Path:
    """The file that the process held at `hold` (`<moment>` or `<moment>@N`) writes in `run_dir`."""
    return Path(run_dir) / f"held-{hold.partition('@')[0]}"


def held_pid(run_dir, hold: str) -> int | None:
    """The pid of the process held at `hold`, once it has written it (None before: the file is created
    empty, then written)."""
    try:
        text = held_file(run_dir, hold).read_text().strip()
    except FileNotFoundError:
        return None
    return int(text) if text else None


def hold(moment: str, run_dir) -> None:
    """Wait here for good when SLURM_RLHF_TEST_HOLD names `moment` (see the module docstring)."""
    nths = [int(nth or 1) for wanted, _, nth in (entry.partition("@") for entry in os.environ.get(ENV, "").split(","))
            if wanted == moment]
    if not nths:
        return
    _reached[moment] = _reached.get(moment, 0) + 1
    if _reached[moment] not in nths:
        return
    path = held_file(run_dir, moment)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return  # (another process holds this moment already)
    with os.fdopen(fd, "w") as f:
        f.write(f"{os.getpid()}\n")
    while path.exists():
        time.sleep(0.1)
