"""The memory allocator of the workers (`run.allocator`).

glibc's malloc serves the large, short-lived tensors of a training step (activations, gradients) from
heaps that it rarely gives back, so a worker's resident memory keeps growing for several steps past what
it holds at any moment. A trainer of the 26M Llama of tools/bench_trl.py (tools/bench_memory.py, 8 steps
of 16 x 160 tokens, 3 runs each) peaked at 2.8-2.9 GB with glibc, 2.1 GB with tcmalloc and 1.8 GB with
jemalloc, in steps of 2.3, 2.1-2.2 and 2.4-2.6 s; vLLM on CPU asks for tcmalloc in LD_PRELOAD too. An
allocator has to be loaded before the process starts, so a worker that was told to use one and does not
have it yet starts itself again, in the same process (same PID) by exec, with the library in LD_PRELOAD
(toolkit/launch/preload.py). A node without the library keeps glibc's malloc and says so.
"""

from __future__ import annotations

import ctypes.util
import os

from toolkit.launch.env import ALLOCATOR as ENV  # the allocator the launcher asks for (run.allocator)

# The libraries, by the name ld.so finds them under (Debian: libtcmalloc-minimal4, libjemalloc2).
LIBRARIES = {"tcmalloc": ("tcmalloc_minimal", "libtcmalloc_minimal.so.4"), "jemalloc": ("jemalloc", "libjemalloc.so.2")}
# `auto`, in the order tried. (Where the trainer runs vLLM in its own process, Flattening, `auto` took
# jemalloc first once: with tcmalloc that worker of tools/bench_trl.py went up to 5.2 GB. That was
# DeepSpeed's 2 GB gradient bucket, now sized to the model (training/engine.py); with tcmalloc that
# worker held 3.05-3.14 GB in 3 runs against jemalloc's 2.89 GB, with steps of 17.0-17.8 s against 18.9-21.0 s.)
ORDERS = {"auto": ("tcmalloc", "jemalloc")}


def library(name: str) -> str | None:
    """The soname of allocator `name` if this node has it, else None."""
    short, soname = LIBRARIES[name]
    return ctypes.util.find_library(short) and soname


def choice(wanted: str) -> tuple[str, str | None]:
    """(allocator, its library) for `wanted` (auto, tcmalloc, jemalloc or system) on this node; `system`
    with None when the library is missing."""
    for name in ORDERS.get(wanted, () if wanted == "system" else (wanted,)):
        lib = library(name)
        if lib:
            return name, lib
    return "system", None


def loaded() -> str:
    """Which allocator this process runs with (by what LD_PRELOAD holds)."""
    preload = os.environ.get("LD_PRELOAD", "")
    return next((name for name, (_, soname) in LIBRARIES.items() if soname in preload), "system")


def describe() -> str:
    """A line for the worker's log: the allocator in use, and what to install when it is not the one asked for."""
    wanted, now = os.environ.get(ENV, "system"), loaded()
    if wanted in ("system", now) or (wanted in ORDERS and now != "system"):
        return f"memory allocator: {now}"
    if now != "system":  # the user's LD_PRELOAD named the other one: it is left as it is
        return f"memory allocator: {now} (already in LD_PRELOAD, so run.allocator {wanted} was not applied)"
    missing = ORDERS.get(wanted, (wanted,))
    return (f"memory allocator: system malloc (run.allocator {wanted}: {' or '.join(missing)} not "
            "found on this node; install libtcmalloc-minimal4 or libjemalloc2 for less memory and faster steps)")
