"""What a worker preloads, first thing: its memory allocator (launch/allocator.py) and, on an AMD CPU, the
library that lets MKL run at full speed there (launch/mkl_amd.py).

A library in LD_PRELOAD has to be there when the process starts, so a worker that lacks what its launcher
asked for replaces itself by exec, in the same process (same PID, so the launcher's PID and process group
still hold), with the libraries in LD_PRELOAD. The fork server does it once for all the workers it forks.
"""

from __future__ import annotations

import os
import sys

from toolkit.launch import allocator, env, mkl_amd

CHECKED = "SLURM_RLHF_PRELOAD_CHECKED"  # set before the exec: a process looks only once


def wanted() -> list[str]:
    """The libraries to add to LD_PRELOAD: the allocator the launcher asked for (unless LD_PRELOAD has one
    already) and, where asked for and this is an AMD CPU, MKL's."""
    libraries = []
    name = os.environ.get(allocator.ENV)
    if name and allocator.loaded() == "system":
        libraries.append(allocator.choice(name)[1])
    if os.environ.get(mkl_amd.ENV) == "1" and not mkl_amd.loaded():
        path, why = mkl_amd.library()
        libraries.append(path)
        if why:  # (for the worker's log line, `mkl_amd.describe`, without trying to build it again)
            os.environ[mkl_amd.WHY] = why
    return [lib for lib in libraries if lib]


def reexec_with_preloads() -> None:
    """First thing in a worker: if it lacks a library it should preload, replace this process by itself
    with them in LD_PRELOAD. Returns when nothing is to be done."""
    if os.environ.get(CHECKED):
        return
    os.environ[CHECKED] = "1"
    libraries = wanted()
    if not libraries:
        return
    os.environ["LD_PRELOAD"] = " ".join(filter(None, (*libraries, os.environ.get("LD_PRELOAD"))))
    os.execv(sys.executable, sys.orig_argv)  # (as started: `python -m toolkit.worker`)


def as_a_worker(allocator_name: str = "auto", fast_mkl_on_amd: bool = True) -> None:
    """For a command or tool that works in its own process (and the processes it starts) as a worker does
    (`generate`, `chat`, `eval`; the benchmarks): preload what a worker of a run with these settings preloads
    (run.allocator, run.fast_mkl_on_amd; by default a run's defaults), unless its environment says otherwise
    (SLURM_RLHF_ALLOCATOR, SLURM_RLHF_FAST_MKL_ON_AMD), by the same exec."""
    os.environ.setdefault(env.ALLOCATOR, allocator_name)
    os.environ.setdefault(env.FAST_MKL_ON_AMD, "1" if fast_mkl_on_amd else "0")
    reexec_with_preloads()


def describe() -> str:
    """What this process runs with, for a command's first line: its allocator and, on an AMD CPU, MKL's
    code paths (with what to install where one is missing)."""
    return "; ".join(filter(None, (allocator.describe(), mkl_amd.describe())))
