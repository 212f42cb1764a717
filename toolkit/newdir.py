"""A directory the toolkit fills for the user (a run, a pipeline, a tiny model set, an export).

It must be new or empty, so that nothing of the user's is mixed with its files, made private with them,
replaced, or removed with them (a submission that fails). One that is written in a single go is built beside
its place and then moved in whole, so that an interrupted build leaves nothing half-written there; what a
build killed outright left beside it the next build there removes.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
from pathlib import Path
from typing import Callable

from toolkit.errors import ConfigError


def check_new(path: Path, label: str, what: str) -> None:
    """ConfigError unless `path` is absent or an empty directory; `label` names it as the user gave it (the
    flag and the path), `what` says what goes into it."""
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{label} is a file; give a new directory for the {what}")
    if path.is_dir() and any(path.iterdir()):
        raise ConfigError(f"{label} is not empty; give a new or empty directory for the {what}, so that nothing "
                          f"in it is mixed with the {what}'s files or replaced")


def build_beside(target: str | os.PathLike, build: Callable[[Path], None]) -> Path:
    """Run `build(tmp)` in a new directory beside `target`, then put it in `target`'s place (whatever is there,
    an empty directory or what the caller chose to replace, goes only once the build is whole)."""
    target = Path(target).resolve()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.building-{os.getpid()}")
    replaced = tmp.with_name(tmp.name + "-replaced")
    for stale in target.parent.glob(f".{target.name}.building-*"):  # (what a build killed by SIGKILL, OOM or a
        if not _building(stale):                                    # lost node left, a model's size, hidden)
            shutil.rmtree(stale, ignore_errors=True)
    tmp.mkdir()
    held = os.open(tmp, os.O_RDONLY)
    with contextlib.suppress(OSError):  # (a file system without locks: then no build is taken as dead)
        fcntl.flock(held, fcntl.LOCK_EX)  # (while it builds: a build of the same target elsewhere leaves it)
    try:
        build(tmp)
        if target.exists():
            target.rename(replaced)
        tmp.rename(target)
        fd = os.open(target.parent, os.O_RDONLY)
        try:
            os.fsync(fd)  # (the rename on disk too)
        finally:
            os.close(fd)
    finally:
        os.close(held)
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(replaced, ignore_errors=True)
    return target


def _building(path: Path) -> bool:
    """Whether a live process builds in `path` (it holds a flock on it; the kernel lets go when it dies)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return True  # (gone already, or not ours to remove)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except OSError:  # (held; or a file system without locks, where nothing can be told)
        return True
    finally:
        os.close(fd)
