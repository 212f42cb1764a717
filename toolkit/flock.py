"""An exclusive kernel lock (flock) on a file or a directory, taken within a time limit.

The kernel releases a flock when its holder dies, so a lock left by a killed process never blocks anyone.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from typing import Callable, Iterator


@contextlib.contextmanager
def flock_held(path: str | os.PathLike, wait_s: float, timeout_error: Callable[[], Exception]) -> Iterator[None]:
    """Hold an exclusive flock on `path`, a directory or a file (created if missing), for the `with` block; if
    another live process holds it for more than `wait_s`, raise `timeout_error()`."""
    # (read-only: a flock needs no write access)
    held = os.open(path, os.O_RDONLY if os.path.isdir(path) else os.O_RDONLY | os.O_CREAT, 0o644)
    try:
        if not take(held, wait_s):
            raise timeout_error()
        try:
            yield
        finally:
            fcntl.flock(held, fcntl.LOCK_UN)
    finally:
        os.close(held)


def take(fd: int, wait_s: float, poll_s: float = 0.2) -> bool:
    """Take an exclusive flock on the open file `fd`, trying every `poll_s` for up to `wait_s`; whether it
    was taken (an OSError other than "held by another": the file system has no locks)."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() > deadline:
                return False
            time.sleep(poll_s)
