"""What every Slurm test shares: no job of this checkout outlives the test that submitted it."""

from __future__ import annotations

import subprocess

import pytest

from tests.conftest import REPO


def jobs_of_this_checkout() -> set[str]:
    """Jobs in the queue whose working directory is this checkout (as `submit` and the tests start them),
    so a suite running beside this one in another clone keeps its jobs."""
    out = subprocess.run(["squeue", "-h", "-o", "%i|%Z"], capture_output=True, text=True, timeout=30).stdout
    return {job for job, _, workdir in (line.partition("|") for line in out.splitlines())
            if workdir.rstrip("/") == str(REPO)}


@pytest.fixture(autouse=True)
def no_job_left_behind():
    """A test that fails half-way (an assertion before its own `cancel`) must not leave a 500-step job on
    the nodes the tests after it need: whatever it submitted is cancelled after it."""
    before = jobs_of_this_checkout()
    yield
    left = jobs_of_this_checkout() - before
    if left:
        subprocess.run(["scancel", *sorted(left)], capture_output=True, timeout=30)
