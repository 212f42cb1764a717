"""Which GPUs the local launcher gives its workers (no GPU needed: the workers' environments are read, no
worker starts)."""

from __future__ import annotations

import pytest

from toolkit.errors import RunError
from toolkit.launch.local import LocalLauncher
from toolkit.launch.rundir import RunDir
from toolkit.placement.plan import WorkerGroup


def given(monkeypatch, tmp_path, visible: str | None, env: dict | None = None,
          machine: int | None = 8) -> dict[str, str]:
    """{worker: CUDA_VISIBLE_DEVICES} that a local run of a generator (1 GPU each, 2 workers), a scorer
    without GPUs and a trainer (2 GPUs) gets, with the driver's CUDA_VISIBLE_DEVICES `visible`, on a machine
    of `machine` GPUs (a stand-in for torch's count; None: this machine's, counted by torch)."""
    if machine is not None:
        monkeypatch.setattr("toolkit.launch.local.machine_gpus", lambda: machine)
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    monkeypatch.setenv("SLURM_RLHF_FORK_SERVER", "0")
    launcher = LocalLauncher(RunDir(tmp_path))
    spawned = {}
    monkeypatch.setattr(launcher, "_spawn", lambda worker, env: spawned.update({worker: env}))
    launcher.start([WorkerGroup("generator", ("generator",), 2, gpus_per_worker=1),
                    WorkerGroup("scorer", ("reference",), 1),
                    WorkerGroup("trainer", ("trainer",), 1, gpus_per_worker=2)], env or {})
    return {worker: e.get("CUDA_VISIBLE_DEVICES") for worker, e in spawned.items()}


def test_workers_get_the_gpus_the_driver_was_given(monkeypatch, tmp_path):
    """With CUDA_VISIBLE_DEVICES=4,5,6,7 (a shared workstation, or salloc without device cgroups) the workers
    took GPUs 0-3, which may be busy or someone else's."""
    assert given(monkeypatch, tmp_path, None) == {"generator:0": "0", "generator:1": "1", "scorer:0": None,
                                                  "trainer:0": "2,3"}
    assert given(monkeypatch, tmp_path, "4, 5,6,7,9") == {  # (a worker without GPUs is left as it was)
        "generator:0": "4", "generator:1": "5", "scorer:0": "4, 5,6,7,9", "trainer:0": "6,7"}
    # (the run's env: section counts as the driver's)
    assert given(monkeypatch, tmp_path, None, {"CUDA_VISIBLE_DEVICES": "GPU-a,GPU-b,GPU-c,GPU-d"})["trainer:0"] == \
        "GPU-c,GPU-d"
    with pytest.raises(RunError, match="the run's workers take 4 GPUs, and CUDA_VISIBLE_DEVICES=1,2 gives this "
                                       "driver 2; give it more"):
        given(monkeypatch, tmp_path, "1,2")
    with pytest.raises(RunError, match="the run's workers take 4 GPUs, and CUDA_VISIBLE_DEVICES= gives this "
                                       "driver 0"):
        given(monkeypatch, tmp_path, "")  # (set, and empty: no GPU)


def test_a_run_that_takes_more_gpus_than_the_machine_has_is_refused(monkeypatch, tmp_path):
    """Without CUDA_VISIBLE_DEVICES the workers took GPUs 0, 1, ... whether the machine had them or not: a config
    planned for 1x8-a100-40g.yaml, run here (no GPU), started 8 workers on CPUs, each with a vLLM engine of
    33.5 GB of KV cache. Now the machine's GPUs are counted (by torch, as the workers count them) first."""
    import subprocess
    import sys

    count = int(subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.device_count())"],
                               capture_output=True, text=True, timeout=300).stdout)
    if count >= 4:
        pytest.skip(f"this machine has {count} GPUs, as many as the run takes")
    with pytest.raises(RunError, match=f"the run's workers take 4 GPUs \\(placement.generator.gpus_per_worker 1 x 2 "
                                       f"workers, placement.trainer.gpus_per_worker 2 x 1 workers\\), and this "
                                       f"machine has {count}; run it where there are that many"):
        given(monkeypatch, tmp_path, None, machine=None)
    with pytest.raises(RunError, match="this machine has 3"):
        given(monkeypatch, tmp_path, None, machine=3)
