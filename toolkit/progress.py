"""Where a stage's lines go. On a terminal: each line printed above a live progress line (tqdm) that
shows the step of the total, the reward (RL) or loss, and the time left from the measured step time.
Elsewhere (a log file, Slurm's output, a pipe): plain lines, a step's line ending with the time left.
"""

from __future__ import annotations

import collections
import shutil
import sys
import time

RECENT = 10  # steps whose mean duration estimates the time left


def duration(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


def elapsed(seconds: float) -> str:
    """`seconds` as "42.4 s", with hours and minutes beside it from an hour on ("93784.2 s (26h03m)")."""
    return f"{seconds:.1f} s" + (f" ({duration(seconds)})" if seconds >= 3600 else "")


class Progress:
    def __init__(self, stream=None, live: bool | None = None):
        self.stream = stream or sys.stdout
        self.live = self.stream.isatty() if live is None else live
        self.bar = None
        self.times: collections.deque = collections.deque(maxlen=RECENT + 1)

    def __call__(self, line: str) -> None:
        """Print a line (above the live line on a terminal)."""
        if self.bar is not None:
            self.bar.write(line, file=self.stream)
        else:
            print(line, file=self.stream, flush=True)

    def eta_s(self, done: int, total: int) -> float | None:
        """Seconds left for `total - done` steps at the mean duration of the recent steps; None until two."""
        if len(self.times) < 2:
            return None
        per_step = (self.times[-1] - self.times[0]) / (len(self.times) - 1)
        return per_step * max(0, total - done)

    def restart_clock(self) -> None:
        """Forget the step times so far (a worker is started again: the step it holds up would make the
        time left too long for the next RECENT steps); the time left shows again after two steps."""
        self.times.clear()

    def step(self, line: str, done: int, total: int | None, summary: str) -> None:
        """Step `done` of `total` is complete: its full `line`, and `summary` for the live line."""
        left = self._advance(done, total)
        if self.live:
            self(line)
            self.show(done, total, f"{summary}  {left}".strip())
        else:
            self(f"{line}  {left}" if left and done < (total or 0) else line)

    def advance(self, done: int, total: int | None, summary: str) -> None:
        """Only the live line (e.g. from a run's status file, whose step lines are printed as they are)."""
        if self.live and done != (self.bar.n if self.bar is not None else None):
            left = self._advance(done, total)
            self.show(done, total, f"{summary}  {left}".strip())

    def _advance(self, done: int, total: int | None) -> str:
        self.times.append(time.monotonic())
        eta = self.eta_s(done, total) if total else None
        return f"eta {duration(eta)}" if eta is not None else ""

    def show(self, done: int, total: int | None, postfix: str) -> None:
        if self.bar is None:
            from tqdm import tqdm

            # (the terminal's size, or 100 x 24 where it reports none, as a pseudo-terminal may: tqdm would
            # hide its line on a terminal of 0 rows)
            size = shutil.get_terminal_size((100, 24))
            self.bar = tqdm(total=total, initial=done, file=self.stream, ncols=size.columns or 100,
                            nrows=size.lines or 24, leave=False,
                            bar_format="{n_fmt}/{total_fmt} |{bar}| {desc}")
        self.bar.n = done
        self.bar.set_description_str(postfix)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
