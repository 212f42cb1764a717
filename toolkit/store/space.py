"""A write into the run directory that failed because its file system (or the user's quota) is full.

Libraries say so badly: Python gives `[Errno 28] No space left on device` without the file, torch's
writer `unexpected pos 576 vs 534`. `DiskFull` says which file, how much room is left where, that the
write was undone, and what to do.
"""

from __future__ import annotations

import contextlib
import errno
import shutil
from pathlib import Path
from typing import Callable

NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
NEARLY_FULL_BYTES = 1 << 20  # less free than this when a write failed: it failed for lack of room


class DiskFull(OSError):
    """A checkpoint or experience file could not be written: no space left (the message says where)."""


def says_no_space(error: BaseException) -> bool:
    """Whether `error`, or an error it came from, is ENOSPC or EDQUOT."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno in NO_SPACE:
            return True
        if isinstance(error, shutil.Error) and error.args and isinstance(error.args[0], list):
            # (copytree gathers its files' errors as text: (source, target, "[Errno 28] ..."))
            if any(f"[Errno {code}]" in str(item[-1]) for item in error.args[0] for code in NO_SPACE):
                return True
        error = error.__cause__ or error.__context__
    return False


def free_bytes(path: Path) -> int | None:
    """Free bytes of the file system that holds `path` (or its nearest existing parent)."""
    path = Path(path)
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def explain(what: str, path: Path, error: BaseException, run_dir: Path) -> BaseException:
    """The error to raise for a write of `what` into `path` (of the run in `run_dir`) that failed with
    `error`, called before the partial files are removed: `DiskFull` naming the path when the disk is
    full, else `error` itself."""
    from toolkit.launch.pipeline import resume_target

    if isinstance(error, DiskFull):  # (a write inside this one said so already: the manifest record of a checkpoint)
        return error
    free = free_bytes(path)
    if not says_no_space(error) and (free is None or free >= NEARLY_FULL_BYTES):
        return error
    room = f"{free / 2**20:.1f} MB free there" if free is not None else "its free space unknown"
    return DiskFull(errno.ENOSPC, f"no space left to write the {what} {path} ({room}; {type(error).__name__}: "
                                  f"{str(error).strip()[:200]}). What was written of it is removed, and what was "
                                  "committed before is untouched: free space (or move the run directory to a "
                                  f"larger file system), then `slurm-rlhf resume {resume_target(run_dir)}` goes on "
                                  "from the last checkpoint")


@contextlib.contextmanager
def named_if_full(what: str, path: Path, run_dir: Path, undo: Callable[[], object] = lambda: None):
    """The block writes `what` into `path` (of the run in `run_dir`): an Exception out of it is `explain`ed
    (measured before `undo` removes what was written of it), then raised."""
    try:
        yield
    except Exception as e:
        error = explain(what, path, e, run_dir)
        undo()
        if error is not e:
            raise error from e
        raise
