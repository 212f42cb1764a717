"""Whether a checkpoint could have been written by someone else: DeepSpeed loads its files with pickle.

torch.load with full unpickling runs whatever code a file names (DeepSpeed's optimizer states need it).
A run directory is its owner's alone (mode 700, and what the run writes in it is not writable by others:
a checkpoint's files are made so before it is renamed into place, even under a default ACL that gives a
group write access whatever the umask), but one made under umask 002 by an earlier version, opened to a
group, or holding another user's files may not be: someone else could have put code in it. A resume
from it is refused, naming the file and the fix, before any of it is loaded (the driver checks when it
plans the resume, `resume --submit` before it submits, and trainer rank 0 again as it loads). What this
cannot tell: files someone else gave you, copied as your own.

Where a file system reports other owners or modes than the real ones for everyone's files (some FUSE,
CIFS or NFS mounts: every file `nobody`'s, or mode 777), `SLURM_RLHF_TRUST_CHECKPOINTS=1` turns the check
off, for the processes of the run that inherit it.
"""

from __future__ import annotations

import grp
import os
import pwd
import stat
from pathlib import Path

from toolkit.errors import RunError

TRUST_ENV = "SLURM_RLHF_TRUST_CHECKPOINTS"


class NotOursAlone(RunError, PermissionError):
    """A checkpoint someone else could have written: the run stops with the file named (exit 1)."""


def check_ours_alone(directory: Path) -> None:
    """Refuse a checkpoint that someone else could have written (NotOursAlone, with the fix): each file
    and directory of it must be this user's, not a link, and not writable by others (see `whose`);
    so must the run directory above it and its `checkpoints` directory (which may be links)."""
    if os.environ.get(TRUST_ENV) == "1":
        return
    run_dir = directory.parent.parent
    chain = [(p, os.stat) for p in (run_dir, directory.parent, directory)]
    for path, look in chain + [(p, os.lstat) for p in sorted(directory.rglob("*"))]:
        fix = f"check what is in it, then `chmod -R go-w {run_dir}`"
        try:
            st = look(path)
        except OSError as e:
            why, fix = f"cannot be looked at ({e.strerror})", "check what is in it"
        else:
            why = whose(st)
            if stat.S_ISLNK(st.st_mode):  # (its own mode is always 777)
                why, fix = "is a symbolic link (a checkpoint holds none)", "check where it points and replace it"
            elif why is not None and why.startswith("belongs"):
                fix = "check what is in it, copy it (the copy is yours) and resume the copy"
        if why is not None:
            raise NotOursAlone(
                f"{path} {why}, and a checkpoint's files are loaded with pickle, which runs code: resume only "
                f"from a run directory that is yours alone ({fix}; on a file system that shows every file "
                f"with another owner or mode, {TRUST_ENV}=1 turns this check off)")


def whose(st: os.stat_result) -> str | None:
    """Why a file or directory with status `st` could have been written by someone other than this user,
    or None: another user's; writable by everyone; or writable by a group other than the user's own (the
    user's primary group, named as the user and with no other members, as where each user has a group of
    their own and umask 002)."""
    if st.st_uid != os.getuid():
        return f"belongs to another user (uid {st.st_uid})"
    mode = f"mode {stat.S_IMODE(st.st_mode):o}"
    if st.st_mode & 0o002:
        return f"may be written by everyone ({mode})"
    if st.st_mode & 0o020 and not _own_group(st.st_gid):
        return f"may be written by the group {_group_name(st.st_gid)!r} ({mode})"
    return None


def _own_group(gid: int) -> bool:
    try:
        me = pwd.getpwuid(os.getuid())
        group = grp.getgrgid(gid)
    except KeyError:
        return False
    return gid == me.pw_gid and group.gr_name == me.pw_name and set(group.gr_mem) <= {me.pw_name}


def _group_name(gid: int) -> str:
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return str(gid)
