"""A worker's own temporary directory: TMPDIR for the worker and every process it starts, removed as it ends.

vLLM removes its temporary files only when it shuts down cleanly: the ZeroMQ IPC sockets of its engine
(`/tmp/<uuid4>`) and the file store of its process group (`/tmp/vllm_dist_<hex>`). A worker that is
stopped (SIGTERM at a time limit or a preemption, `scancel`, Ctrl-C at the driver) or that has lost its
driver ends its engine with SIGKILL, so every stopped run left such files in the /tmp of its nodes.
Each worker now makes a directory of its own (mode 700) in the temporary directory it was given, points
TMPDIR and Python's `tempfile` at it, and removes it on every way out that it controls. A worker killed
by SIGKILL (the OOM killer; a stop whose SIGTERM it could not act on within the grace time, as in a long
call into C on a busy node) leaves that one directory, named after it and its pid:
`slurm-rlhf-<group>-<rank>-<pid>`. The local launcher removes it once the process has ended
(`remove_left`); under Slurm it is on the worker's node, where the driver cannot reach.

vLLM's tensor-parallel ranks on CPUs also exchange tensors through shared memory, files in /dev/shm named
after the file store of their group (`/dev/shm/vllm_dist_<hex>-tp:0-[0-1]-cpushm_<rank>`, 4 MB each: RAM
until the node reboots), which the ranks do not remove as they are ended (the worker kills them): every
start of a generator with `rollout.vllm.tensor_parallel_size` 2 left 8 MB there (13 pairs on one machine
after a day of test runs). They are removed with the directory, by the names of the file stores it holds
and of those it held once vLLM's ranks ran (`note_file_stores`: a clean shutdown removes the store, not
the files in /dev/shm).
"""

from __future__ import annotations

import os
import shutil
import stat
import tempfile

SOCKET_PATH_MAX = 107  # bytes in the path of a Unix socket on Linux (sun_path, less its NUL)
IPC_NAME = 37  # what vLLM adds to the directory for each IPC socket: "/" and a uuid4
SHARED_MEMORY = "/dev/shm"

_own: str | None = None
_stores: set[str] = set()  # vLLM file stores seen in `_own` (note_file_stores)


def make_own(name: str) -> str | None:
    """Make this process's own temporary directory and point TMPDIR at it; its path, or None where the
    directory given is so deep that a socket in a directory below it would pass the length limit (then
    TMPDIR stays as it is)."""
    global _own
    tempfile.tempdir = None  # (a worker forked from the fork server: what the server found, looked up again)
    given = tempfile.gettempdir()
    path = _own_path(given, name, os.getpid())
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:  # (left by a killed process that had this pid, or not ours: a name of its own)
        path = tempfile.mkdtemp(prefix=os.path.basename(path) + "-")
    if len(os.fsencode(path)) + IPC_NAME > SOCKET_PATH_MAX:
        os.rmdir(path)
        return None
    # torch.compile's cache (GPU runs that compile) stays where torch keeps it, for the next start, where that
    # is this user's own: torch loads code and pickles from it, and /tmp is shared (else it goes in `path`)
    cache = os.path.join(given, f"torchinductor_{_user()}")
    if "TORCHINDUCTOR_CACHE_DIR" not in os.environ and _ours(cache):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
    os.environ["TMPDIR"] = tempfile.tempdir = _own = path
    return path


def _own_path(given: str, name: str, pid: int) -> str:
    """Where the worker `name` with process id `pid` makes its directory in the temporary directory `given`."""
    return os.path.join(given, f"slurm-rlhf-{name}-{pid}")


def _ours(path: str) -> bool:
    """Whether `path` is a real directory that only this user may write to (store/ownership.py's rule: a
    group-writable one only where the group is the user's own, the norm where umask is 002). Where it is
    not there yet, it is made now (mode 700), so that nobody else can make it between this check and
    torch's first use."""
    from toolkit.store.ownership import whose

    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError:
        return False
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and whose(st) is None


def _user() -> str:
    """The user name as torch puts it in the name of its compile cache."""
    import getpass
    import re

    try:
        return re.sub(r'[\\/:*?"<>|]', "_", getpass.getuser())
    except (KeyError, OSError):
        return str(os.getuid())


def remove_left(env: dict[str, str], name: str, pid: int) -> None:
    """Remove the directory `make_own(name)` made in process `pid`, which has ended, if it is still there and
    ours: `env` is the environment the process started with (its TMPDIR)."""
    given = next((env[k] for k in ("TMPDIR", "TEMP", "TMP") if env.get(k)), None) or tempfile.gettempdir()
    path = _own_path(given, name, pid)
    try:
        st = os.lstat(path)
    except OSError:
        return
    if stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid():
        _remove_shared_memory(_file_stores(path))
        shutil.rmtree(path, ignore_errors=True)


def remove_own() -> None:
    """Remove this process's own temporary directory and what is in it (nothing if none was made)."""
    if _own is not None:
        _remove_shared_memory(_stores | _file_stores(_own))
        shutil.rmtree(_own, ignore_errors=True)


def note_file_stores() -> None:
    """Remember the vLLM file stores in this process's own directory (once its engine's ranks run), whose files
    in /dev/shm `remove_own` removes also where vLLM removed the store itself."""
    if _own is not None:
        _stores.update(_file_stores(_own))


def _file_stores(path: str) -> set[str]:
    try:
        return {name for name in os.listdir(path) if name.startswith("vllm_dist_")}
    except OSError:
        return set()


def _remove_shared_memory(stores: set[str]) -> None:
    """Remove this user's files in /dev/shm of the vLLM file stores named `stores` (see above)."""
    import glob

    for store in stores:
        for shm in glob.glob(os.path.join(SHARED_MEMORY, glob.escape(store) + "-*")):
            try:
                if os.lstat(shm).st_uid == os.getuid():
                    os.unlink(shm)
            except OSError:
                pass
