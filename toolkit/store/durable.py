"""A directory written under a temporary name, then put in place of the one before (an export, a
checkpoint): on disk before it is named, and never left half in place.

`settle` makes every file and folder under it not writable by others (a resume requires that, see
store/ownership.py; a default ACL on a project directory gives its group write access whatever the umask)
and fsyncs them: a rename alone does not order the files' data before it, so after a crash the manifest
could name a folder of empty files. `put_in_place` moves the folder before it aside under a name of its
own (not a fixed `.old`, which a killed removal, or a file held open on NFS, leaves behind for the next
rename to fail on), renames the new one in, and only then removes the old one.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from pathlib import Path

from toolkit.store.experience import fsync_dir


def settle(root: Path) -> None:
    """Every file and folder under `root` (and itself): not writable by others, and on disk."""
    root = Path(root)
    for path in [*sorted(root.rglob("*"), reverse=True), root]:  # (a folder after what it holds)
        with contextlib.suppress(OSError):  # (a file system without modes refuses)
            path.chmod(path.stat().st_mode & ~0o022)
        if path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())
        else:
            fsync_dir(path)


def put_in_place(tmp: Path, final: Path) -> None:
    """Rename the settled folder `tmp` to `final`, in place of what `final` held, and remove that (and the
    remains of earlier moves that could not be removed)."""
    tmp, final = Path(tmp), Path(final)
    for stale in final.parent.glob(f".{final.name}.old*"):  # (".old": an earlier version's)
        shutil.rmtree(stale, ignore_errors=True)
    old = final.parent / f".{final.name}.old-{os.getpid()}-{time.time_ns()}"
    if final.exists():
        os.replace(final, old)
    try:
        os.replace(tmp, final)
    except BaseException:
        if old.exists():
            os.replace(old, final)  # (what was there stays)
        raise
    fsync_dir(final.parent)
    shutil.rmtree(old, ignore_errors=True)
