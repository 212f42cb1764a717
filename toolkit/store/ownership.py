"""Whether a checkpoint could have been written by someone else: DeepSpeed loads its files with pickle.

torch.load with full unpickling runs whatever code a file names (DeepSpeed's optimizer states need it).
A run directory is its owner's alone (mode 700, files 600: RunDir.private), but one made by an earlier
version under umask 002, opened to a group, or holding another user's files may not be: someone else
could have put code in it. A resume from it is refused, naming the file and the fix, before any of it is
loaded (the driver checks when it plans the resume, and each trainer rank again as it loads). What this
cannot tell: files someone else gave you, copied as your own.
"""

from __future__ import annotations

import getpass
import grp
import os
import stat
from pathlib import Path


def check_ours_alone(directory: Path) -> None:
    """Refuse a checkpoint that someone else could have written: DeepSpeed loads its files with pickle,
    which runs whatever code a file names. Each file and directory of it, and the run directory above it,
    must be this user's and not writable by others; writable by its group only where that group is the
    user's own (named as the user, as where each user has a group of their own and umask 002)."""
    me = os.getuid()
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = None
    run_dir = directory.parent.parent
    for path in [run_dir, directory.parent, directory, *sorted(directory.rglob("*"))]:
        st = path.stat()
        mode = f"mode {stat.S_IMODE(st.st_mode):o}"
        fix = f"check what is in it, then `chmod -R go-w {run_dir}`"
        if st.st_uid != me:
            why = f"belongs to another user (uid {st.st_uid})"
            fix = "check what is in it, copy it (the copy is yours) and resume the copy"
        elif st.st_mode & 0o002:
            why = f"may be written by everyone ({mode})"
        elif st.st_mode & 0o020 and _group_name(st.st_gid) != user:
            why = f"may be written by the group {_group_name(st.st_gid)!r} ({mode})"
        else:
            continue
        raise PermissionError(f"{path} {why}, and a checkpoint's files are loaded with pickle, which runs code: "
                              f"resume only from a run directory that is yours alone ({fix})")


def _group_name(gid: int) -> str:
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return str(gid)
