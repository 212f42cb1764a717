"""How a run's OpenMP threads wait (toolkit/launch/openmp.py, `run.openmp_spin`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from toolkit.launch import openmp

REPO = Path(__file__).resolve().parents[2]

# Parallel regions of torch's CPU kernels on 2 threads, each followed by 50 ms of sleep in the main thread:
# what the other thread of the team does meanwhile shows in the process's CPU time.
REGIONS = """
import json, os, time, torch
torch.set_num_threads(2)
a = torch.ones(256, 256)
for _ in range(3):
    a @ a
started = os.times()
for _ in range(30):
    a @ a
    time.sleep(0.05)
ended = os.times()
print(json.dumps({"cpu": ended.user - started.user + ended.system - started.system}))
"""


def cpu_seconds(**env: str) -> float:
    clean = {k: v for k, v in os.environ.items() if k not in (openmp.VARIABLE, openmp.SPIN, "OMP_NUM_THREADS")}
    done = subprocess.run([sys.executable, "-c", REGIONS], env={**clean, **env}, cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)["cpu"]


def test_workers_spin_as_asked_unless_the_environment_says_otherwise(monkeypatch):
    monkeypatch.delenv(openmp.SPIN, raising=False)
    assert openmp.spin(0) == {}  # (the default: they sleep at once, OMP_WAIT_POLICY=PASSIVE)
    assert openmp.spin(3000) == {"GOMP_SPINCOUNT": "3000"}
    monkeypatch.setenv(openmp.VARIABLE, "PASSIVE")
    assert openmp.describe() == "OMP_WAIT_POLICY=PASSIVE"
    monkeypatch.setenv(openmp.SPIN, "100")  # the user's own setting: the workers inherit it
    assert openmp.spin(3000) == {}
    assert openmp.describe() == ("OMP_WAIT_POLICY=PASSIVE, GOMP_SPINCOUNT=100 (each spins that many times before it "
                                 "sleeps)")


def test_the_spin_count_reaches_torchs_openmp_threads():
    """GOMP_SPINCOUNT overrides OMP_WAIT_POLICY=PASSIVE in torch's GNU OpenMP: with a count far longer than
    the sleeps, the idle thread spins through them (CPU time near the 1.5 s slept); passive, it sleeps."""
    passive = cpu_seconds(OMP_WAIT_POLICY="PASSIVE")
    spinning = cpu_seconds(OMP_WAIT_POLICY="PASSIVE", GOMP_SPINCOUNT=str(10**12))
    assert passive < 0.3 and spinning > max(0.4, 3 * passive), (passive, spinning)
