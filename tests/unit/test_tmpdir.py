"""A worker's own temporary directory (toolkit/tmpdir.py): made private in the directory given, TMPDIR and
`tempfile` pointed at it, torch's compile cache kept in the directory given only where it is this
user's own (made private there where it is absent), removed whole; not made where a
socket below it would pass the length limit of a Unix socket's path."""

from __future__ import annotations

import os
import socket
import stat
import tempfile
import uuid

import pytest

from toolkit import tmpdir

SHM = "/dev/shm"  # (where shm_open makes its files on Linux)


@pytest.fixture
def given(monkeypatch):
    """A short temporary directory as TMPDIR, and the module's state as a fresh worker has it."""
    base = tempfile.mkdtemp(prefix="srl-")
    monkeypatch.setenv("TMPDIR", base)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "")  # (set first, so that the delete is undone after)
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    monkeypatch.setattr(tempfile, "tempdir", "/somewhere/else")  # (as a worker forked from the fork server)
    monkeypatch.setattr(tmpdir, "_own", None)
    monkeypatch.setattr(tmpdir, "_stores", set())
    yield base
    cache = os.path.join(base, f"torchinductor_{tmpdir._user()}")
    if os.path.isdir(cache) and not os.path.islink(cache):  # (made by make_own, or by the test)
        os.rmdir(cache)
    os.rmdir(base)  # (fails where anything else was left in it)


@pytest.mark.parametrize("how", ["writable by all", "another user's", "a link"])
def test_a_compile_cache_in_the_shared_directory_that_is_not_ours_alone_is_not_used(given, how):
    """torch loads code and pickles from its compile cache, and anyone can make /tmp/torchinductor_<user>
    first: then the cache stays in the worker's own directory (torch's default under TMPDIR)."""
    cache = os.path.join(given, f"torchinductor_{tmpdir._user()}")
    if how == "a link":
        os.symlink(given, cache)
    else:
        os.mkdir(cache, 0o700)
        if how == "writable by all":
            os.chmod(cache, 0o777)
        elif os.getuid() == 0:
            os.chown(cache, 65534, 65534)
        else:
            pytest.skip("making a directory of another user needs root")
    try:
        tmpdir.make_own("trainer-0")
        assert "TORCHINDUCTOR_CACHE_DIR" not in os.environ
        tmpdir.remove_own()
    finally:
        if how == "a link":  # (a directory is removed by the fixture)
            os.unlink(cache)


def test_own_directory_made_used_and_removed(given):
    path = tmpdir.make_own("generator-0")
    assert os.path.dirname(path) == given and os.path.basename(path) == f"slurm-rlhf-generator-0-{os.getpid()}"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o700
    assert os.environ["TMPDIR"] == path and tempfile.gettempdir() == path
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"].startswith(os.path.join(given, "torchinductor_"))
    # what vLLM leaves when it is killed: a file store and an IPC socket, both in the worker's directory
    with tempfile.NamedTemporaryFile(prefix="vllm_dist_", delete=False) as f:
        f.write(b"x")
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(os.path.join(path, "0f6bc5f2-b647-4ad7-9388-d4efea6d35dd"))  # (a uuid4, as vLLM names them)
    os.makedirs(os.path.join(tempfile.gettempdir(), "tmpxyzwandb-media", "deeper"))
    assert os.path.dirname(f.name) == path and len(os.listdir(path)) == 3
    tmpdir.remove_own()
    sock.close()
    # (left: the compile cache, made private before torch could look for it; anyone could make it first)
    cache = f"torchinductor_{tmpdir._user()}"
    assert os.listdir(given) == [cache] and stat.S_IMODE(os.stat(os.path.join(given, cache)).st_mode) == 0o700


def test_too_deep_for_a_socket_below_it_leaves_tmpdir_as_it_was(given, monkeypatch):
    deep = os.path.join(given, "d" * (tmpdir.SOCKET_PATH_MAX - tmpdir.IPC_NAME - len(given) - 20))
    os.mkdir(deep)
    monkeypatch.setenv("TMPDIR", deep)
    assert tmpdir.make_own("generator-0") is None
    assert os.environ["TMPDIR"] == deep and os.listdir(deep) == []
    tmpdir.remove_own()  # (nothing to remove)
    assert os.path.isdir(deep)
    os.rmdir(deep)


def test_what_a_killed_worker_left_is_removed_by_its_launcher(given, monkeypatch):
    """A worker killed before it could remove its directory (SIGKILL at the end of a stop's grace time)
    leaves `slurm-rlhf-<name>-<pid>`; the local launcher removes it by that name once the process has ended.
    A directory of that name made earlier, by a process that had the same pid, is not taken over."""
    env = {"TMPDIR": given}
    left = os.path.join(given, "slurm-rlhf-trainer-0-4242")
    os.makedirs(os.path.join(left, "vllm"))
    tmpdir.remove_left(env, "trainer-0", 4243)  # (another process's: kept)
    assert os.path.isdir(left)
    tmpdir.remove_left(env, "trainer-0", 4242)
    assert os.listdir(given) == []
    os.symlink(given, left)  # (not a directory of its own: kept)
    tmpdir.remove_left(env, "trainer-0", 4242)
    assert os.path.islink(left)
    os.unlink(left)
    taken = os.path.join(given, f"slurm-rlhf-scorer-0-{os.getpid()}")
    os.mkdir(taken)
    path = tmpdir.make_own("scorer-0")
    assert path != taken and os.path.basename(path).startswith(f"slurm-rlhf-scorer-0-{os.getpid()}-")
    tmpdir.remove_own()
    os.rmdir(taken)


def test_shared_memory_of_vllm_ranks_is_removed_with_the_directory(given):
    """vLLM's tensor-parallel ranks on CPUs share tensors through files in /dev/shm named after the file store
    of their group, which is in the worker's directory; nothing removed them (4 MB each, in RAM): not the ranks
    killed with their worker, nor a clean shutdown of vLLM, which removes only the store. They go with the
    directory, by the worker (also the files of a store it noted once the ranks ran, removed since) or by its
    launcher; those of another file store (another worker's) stay."""
    def shared(store: str) -> list[str]:
        names = [f"{store}-tp:0-[0-1]-cpushm_{rank}" for rank in (0, 1)]  # (as vLLM's ranks name them)
        for name in names:
            fd = os.open(os.path.join(SHM, name), os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            os.ftruncate(fd, 4 * 2**20)
            os.close(fd)
        return names

    stores = [f"vllm_dist_{uuid.uuid4().hex}" for _ in range(4)]
    path = tmpdir.make_own("generator-0")
    left = os.path.join(given, "slurm-rlhf-generator-1-4242")  # (a worker killed before it removed its own)
    os.mkdir(left, 0o700)
    for directory, store in ((path, stores[0]), (path, stores[1]), (left, stores[2])):
        with open(os.path.join(directory, store), "wb") as f:
            f.write(b"x")
    names = [shared(store) for store in stores]
    tmpdir.note_file_stores()  # (as the engine does once its ranks run)
    os.unlink(os.path.join(path, stores[1]))  # (vLLM's clean shutdown: the store goes, its files in /dev/shm stay)
    try:
        tmpdir.remove_own()
        tmpdir.remove_left({"TMPDIR": given}, "generator-1", 4242)
        there = set(os.listdir(SHM))
        assert there.isdisjoint(names[0] + names[1] + names[2]) and set(names[3]) <= there
        assert not os.path.exists(path) and not os.path.exists(left)
    finally:
        for name in sum(names, []):
            if os.path.exists(os.path.join(SHM, name)):
                os.unlink(os.path.join(SHM, name))
