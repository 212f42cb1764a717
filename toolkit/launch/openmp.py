"""OpenMP threads that wait by sleeping: OMP_WAIT_POLICY=PASSIVE in every process of a run, unless the
user's environment sets OMP_WAIT_POLICY itself.

torch's CPU kernels (and DeepSpeed's CPU Adam) run in a GNU OpenMP team as wide as the CPUs the process
may use. By default a thread that has done its part spins while it waits for the rest of the team. Where
the CPUs are shared with anything else (another worker of the run, another test, another user's job on
the node), a member of the team is often not running, and each of the thousands of small parallel
regions of a step waits for the scheduler to run it again. Measured here (2 cores; README, "OpenMP
threads sleep while they wait"; `tools/bench_openmp.py`): a step of the tiny GRPO run took 9.8 s beside
one busy process with GNU OpenMP's default, against 1.06 s with passive waits; alone, 0.87 s and 0.83 s.

Where a worker has its CPUs to itself, the wake-ups cost instead: `run.openmp_spin` has the workers'
threads spin that many times first (GOMP_SPINCOUNT, which GNU OpenMP takes over the policy); see `spin`.
"""

from __future__ import annotations

import os

VARIABLE = "OMP_WAIT_POLICY"
DEFAULT = "PASSIVE"
SPIN = "GOMP_SPINCOUNT"  # GNU OpenMP: how long a waiting thread spins before it sleeps (it overrides the policy)


def wait_passively() -> None:
    """Set OMP_WAIT_POLICY=PASSIVE unless it is set; before torch is imported (OpenMP reads it when it
    loads), and the processes this one starts inherit it."""
    os.environ.setdefault(VARIABLE, DEFAULT)


def spin(count: int) -> dict[str, str]:
    """What a run's workers get for `run.openmp_spin` = `count`: GOMP_SPINCOUNT, unless `count` is 0 (they
    sleep at once) or the user's environment sets GOMP_SPINCOUNT itself (then they inherit that)."""
    return {SPIN: str(count)} if count and SPIN not in os.environ else {}


def describe() -> str:
    """How this process's OpenMP threads wait, for its log."""
    line = f"{VARIABLE}={os.environ.get(VARIABLE, 'unset')}"
    if SPIN in os.environ:
        line += f", {SPIN}={os.environ[SPIN]} (each spins that many times before it sleeps)"
    return line
