"""How a launcher reports a worker (or a Slurm step of workers) that ended."""

from __future__ import annotations

import signal
import subprocess
import time
from dataclasses import dataclass
from typing import Iterable


@dataclass
class Exit:
    worker_id: str          # the worker to blame (for a Slurm step: the task that failed first)
    code: int               # exit code; negative: killed by that signal
    detail: str = ""        # what the launcher knows beyond the code (e.g. srun's report)

    def describe(self) -> str:
        if self.code < 0:
            try:
                text = f"signal {signal.Signals(-self.code).name}"
            except ValueError:
                text = f"signal {-self.code}"
        else:
            text = f"exit code {self.code}"
        return f"{text} ({self.detail})" if self.detail else text


def wait_all(procs: Iterable[subprocess.Popen], timeout_s: float) -> bool:
    """Wait until every process has exited; True if they all did within `timeout_s`."""
    procs = list(procs)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if all(p.poll() is not None for p in procs):
            return True
        time.sleep(0.1)
    return False
