"""run.allocator: a worker starts itself again, same PID, with the allocator preloaded, or says what is missing."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from toolkit.launch import allocator, mkl_amd, preload

REPO = Path(__file__).resolve().parents[2]
# What a worker does first, then what it would log (a -c program is started again as it was: `python -c ...`).
PROGRAM = ("import json, os; from toolkit.launch import allocator, preload; preload.reexec_with_preloads(); "
           "print(json.dumps({'pid': os.getpid(), 'loaded': allocator.loaded(), 'line': allocator.describe(), "
           "'preload': os.environ.get('LD_PRELOAD', '')}))")


def started(wanted: str | None, **extra) -> tuple[int, dict]:
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", allocator.ENV, preload.CHECKED, mkl_amd.ENV)}
    env.update(extra)
    if wanted is not None:
        env[allocator.ENV] = wanted
    proc = subprocess.Popen([sys.executable, "-c", PROGRAM], cwd=REPO, env=env, stdout=subprocess.PIPE, text=True)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0
    return proc.pid, json.loads(out)


def test_choice_falls_back_in_order_and_to_system(monkeypatch):
    assert allocator.choice("system") == ("system", None)
    monkeypatch.setitem(allocator.LIBRARIES, "tcmalloc", ("no_such_allocator_lib", "libno_such.so.1"))
    monkeypatch.setitem(allocator.LIBRARIES, "jemalloc", ("no_such_allocator_lib", "libno_such.so.2"))
    assert allocator.choice("auto") == ("system", None)
    assert allocator.choice("jemalloc") == ("system", None)


@pytest.mark.skipif(allocator.choice("auto")[1] is None, reason="neither tcmalloc nor jemalloc is installed")
def test_a_worker_runs_again_in_its_own_process_with_the_allocator():
    name, lib = allocator.choice("auto")
    pid, got = started("auto")
    assert got["pid"] == pid  # exec: the same process, so the launcher's PID and process group still hold
    assert got["loaded"] == name and got["preload"].startswith(lib)
    assert got["line"] == f"memory allocator: {name}"
    for explicit in ("tcmalloc", "jemalloc"):
        if allocator.library(explicit):
            assert started(explicit)[1]["loaded"] == explicit


def test_system_or_nothing_asked_keeps_glibc_and_a_missing_library_is_named():
    for wanted in ("system", None):
        pid, got = started(wanted)
        assert got["pid"] == pid and got["loaded"] == "system" and got["preload"] == ""
    # once looked (the marker is set), a process is not started again, and its log line says what to install
    _, got = started("jemalloc", **{preload.CHECKED: "1"})
    assert got["loaded"] == "system"
    assert "run.allocator jemalloc: jemalloc not found on this node; install" in got["line"]


@pytest.mark.skipif(not (allocator.library("tcmalloc") and allocator.library("jemalloc")),
                    reason="needs both tcmalloc and jemalloc")
def test_an_allocator_the_user_preloaded_is_kept_and_named():
    pid, got = started("tcmalloc", LD_PRELOAD=allocator.library("jemalloc"))
    assert got["pid"] == pid and got["loaded"] == "jemalloc"
    assert got["line"] == ("memory allocator: jemalloc (already in LD_PRELOAD, so run.allocator tcmalloc was not "
                           "applied)")
