"""Which GPUs the local launcher gives its workers (no GPU needed: the workers' environments are read, no
worker starts)."""

from __future__ import annotations

import pytest

from toolkit.errors import RunError
from toolkit.launch import local
from toolkit.launch.local import LocalLauncher
from toolkit.launch.rundir import RunDir
from toolkit.placement.plan import WorkerGroup


def given(monkeypatch, tmp_path, visible: str | None, env: dict | None = None) -> dict[str, str]:
    """{worker: CUDA_VISIBLE_DEVICES} that a local run of a generator (1 GPU each, 2 workers), a scorer
    without GPUs and a trainer (2 GPUs) gets, with the driver's CUDA_VISIBLE_DEVICES `visible`."""
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
    monkeypatch.setattr(local, "gpu_count", lambda: 8, raising=False)  # (unset: GPUs 0, 1, ... of a machine of 8)
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


def test_gpus_asked_of_a_machine_without_enough_is_an_error(monkeypatch, tmp_path):
    """gpus_per_worker on a machine without GPUs (CUDA_VISIBLE_DEVICES unset) handed out GPUs 0, 1, ... that
    do not exist: the run trained on its CPUs and said nothing. Now it stops before anything starts and
    names the settings (this machine's own count, from torch)."""
    import torch

    have = torch.cuda.device_count()
    if have >= 4:
        pytest.skip(f"this machine has {have} GPUs, enough for the run")
    with pytest.raises(RunError) as error:
        given(monkeypatch, tmp_path, None)
    assert str(error.value) == (
        "the run's workers take 4 GPUs (placement.generator.gpus_per_worker 1 x 2 workers, "
        f"placement.trainer.gpus_per_worker 2 x 1 workers), and this machine has {have}; set gpus_per_worker 0 "
        "to run on CPUs, or run where there are enough GPUs")
