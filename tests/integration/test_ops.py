"""DeepSpeed's compiled ops still load after a process was killed while loading them (training/ops.py).

Each test works on a copy of the installation's build of the shared-memory op, in a folder of its own
(TORCH_EXTENSIONS_DIR), so a lock file it leaves cannot stop the rest of the suite."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

OP = "deepspeed_shm_comm"
LOAD = "from toolkit.training.ops import load_ops; print('loaded', load_ops(wait_s={wait}))"


@pytest.fixture
def extensions(tmp_path):
    """A TORCH_EXTENSIONS_DIR holding a copy of the installation's build of the op (mtimes kept, so
    ninja finds it up to date; without a build there, the first load compiles it, about 40 s)."""
    folder = tmp_path / "torch_extensions"
    built = os.path.join(os.environ["TORCH_EXTENSIONS_DIR"], OP)
    if os.path.exists(os.path.join(built, f"{OP}.so")):
        shutil.copytree(built, folder / OP, ignore=shutil.ignore_patterns("lock", "load.flock"))
    folder.mkdir(exist_ok=True)
    return folder


def load(extensions, wait_s: float = 300, timeout: float = 400) -> subprocess.CompletedProcess:
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(extensions)}
    return subprocess.run([sys.executable, "-c", LOAD.format(wait=wait_s)], env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_a_lock_file_left_by_a_killed_load_is_removed_and_the_op_loads(extensions):
    """torch's lock file as a process killed inside `cpp_extension.load` leaves it: plain DeepSpeed waits
    for it to go, forever (the symptom of a CI run whose trainers all hung at start-up); load_ops removes it."""
    (extensions / OP).mkdir(exist_ok=True)
    (extensions / OP / "lock").touch()
    done = load(extensions)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"loaded ['{OP}']" in done.stdout
    assert "left by a process killed while it loaded DeepSpeed's deepspeed_shm_comm op" in done.stderr
    assert not (extensions / OP / "lock").exists()


def test_a_live_loader_is_waited_for_and_its_lock_file_kept_until_it_dies(extensions):
    """A process that holds the flock is loading the op now: its lock file is not stale. The next load
    waits for it and, past its wait, fails with a message naming the flock, leaving the file alone; once
    that process is killed (its lock file left behind), the next load removes the file and loads."""
    (extensions / OP).mkdir(exist_ok=True)
    flock = extensions / OP / "load.flock"
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import fcntl, os, sys, time\n"
         f"f = open({str(flock)!r}, 'a+'); fcntl.flock(f, fcntl.LOCK_EX)\n"
         f"open({str(extensions / OP / 'lock')!r}, 'x').close(); print('held', flush=True); time.sleep(600)"],
        stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        started = time.monotonic()
        waited = load(extensions, wait_s=2)
        assert waited.returncode != 0
        assert "OpLockTimeout" in waited.stderr and str(flock) in waited.stderr, waited.stderr[-3000:]
        assert time.monotonic() - started >= 2
        assert (extensions / OP / "lock").exists()
    finally:
        os.killpg(holder.pid, signal.SIGKILL)
        holder.wait(timeout=60)
    done = load(extensions)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"loaded ['{OP}']" in done.stdout
    assert not (extensions / OP / "lock").exists()


def test_deepspeeds_world_group_made_at_join_loads_the_op_through_the_flock(extensions):
    """`Ranks.join` makes DeepSpeed's clone of the default group early (training/ranks.py), and DeepSpeed's
    init_distributed loads the shared-memory op. That load must go through load_op too: unguarded, it took
    torch's lock file while a trainer rank beside it, in load_op, removed that file as left by a dead
    process, and the first process then failed in its release (a CI run: `FileNotFoundError: ...
    deepspeed_shm_comm/lock`); and a stale file made it wait forever. With a stale file in place, the
    group is made and the file is gone."""
    (extensions / OP).mkdir(exist_ok=True)
    (extensions / OP / "lock").touch()
    code = ("import torch.distributed as dist\n"
            "dist.init_process_group('gloo', store=dist.HashStore(), rank=0, world_size=1)\n"
            "from toolkit.training.ranks import _deepspeed_world_group\n"
            "_deepspeed_world_group(); print('made', flush=True)\n")
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(extensions)}
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"waited 300 s: the load waited for the stale lock file\n{err[-3000:]}")
    assert proc.returncode == 0 and "made" in out, err[-3000:]
    assert "left by a process killed while it loaded DeepSpeed's deepspeed_shm_comm op" in err
    assert not (extensions / OP / "lock").exists()
