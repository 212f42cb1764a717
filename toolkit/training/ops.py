"""DeepSpeed's compiled ops (its shared-memory collectives on CPU, the CPU Adam of ZeRO-Offload), loaded
so that a process killed while loading them cannot stop every later run.

DeepSpeed compiles these ops on first use with torch's `cpp_extension.load` into TORCH_EXTENSIONS_DIR
(tools/setup.sh builds them there ahead of time). Every process that loads one, even when it is built
already, holds a lock file, `<folder>/<op>/lock`, while ninja checks the build; the file is removed when
the load ends. A process killed in that moment (a SIGKILL, a worker's SIGTERM handler, a Slurm step
cancelled) leaves the file behind, and every later load waits for it to go, without a timeout, so every
trainer of every later run hangs at start-up (reproduced with such a file; a CI run's trainers, RL and
SFT, all hung at start-up from its tests that stop runs at every moment on, the same symptom).

`load_ops` loads them before DeepSpeed does, holding a kernel lock (flock) beside torch's lock file. The
kernel releases a flock when its holder dies, so a process holding it knows that any torch lock file of
that op was left by a dead process (every load of this installation's trainers and of tools/setup.sh
comes through here), and removes it. DeepSpeed keeps a loaded op for the process's life, so its own
loads later find the op loaded and take no lock.
"""

from __future__ import annotations

import logging
import os

from toolkit.flock import flock_held

log = logging.getLogger(__name__)

WAIT_S = 1800.0  # (another process may be compiling the op: 40 s on 2 idle cores, minutes on busy ones)


class OpLockTimeout(RuntimeError):
    """Another live process held an op's flock for longer than the wait."""


def build_folder(name: str) -> str:
    """Where torch's cpp_extension builds op `name` (and keeps its lock file)."""
    from torch.utils.cpp_extension import _get_build_directory

    return _get_build_directory(name, verbose=False)


def load_op(builder, wait_s: float = WAIT_S):
    """`builder.load()` under the op's flock, after removing a torch lock file that a dead process left."""
    folder = build_folder(builder.name)
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "load.flock")

    def timeout() -> OpLockTimeout:
        return OpLockTimeout(f"waited {wait_s:.0f} s for another process to load DeepSpeed's {builder.name} op "
                             f"(it holds {path}); if that process hangs, end it (`fuser {path}` names it)")

    with flock_held(path, wait_s, timeout):
        stale = os.path.join(folder, "lock")
        if os.path.exists(stale):
            log.warning("removing %s, left by a process killed while it loaded DeepSpeed's %s op "
                        "(every later load would have waited for it forever)", stale, builder.name)
            os.remove(stale)
        return builder.load()


def load_ops(cpu_adam: bool = False, wait_s: float = WAIT_S) -> list[str]:
    """Load the ops a DeepSpeed engine of this process will load: the shared-memory collectives where the
    accelerator has them and DeepSpeed finds them compatible (deepspeed.comm's own test), and with
    `cpu_adam` the CPU Adam. Returns the names of the ops loaded."""
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator

    builders = []
    shm = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if shm is not None and deepspeed.ops.__compatible_ops__.get(shm.NAME, False):
        builders.append(shm)
    if cpu_adam:
        from deepspeed.ops.op_builder import CPUAdamBuilder

        builders.append(CPUAdamBuilder())
    for builder in builders:
        load_op(builder, wait_s)
    return [builder.name for builder in builders]
