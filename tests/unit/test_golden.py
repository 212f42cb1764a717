"""Golden files: `submit --dry-run` output and rendered batch scripts, with paths holding spaces and quotes.

If a change to them is intended, regenerate with:  UPDATE_GOLDEN=1 bash tools/test.sh -k golden
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.conftest import REPO, cli, example, write_config
from toolkit.config import load_config
from toolkit.launch.allocation import plan_allocation
from toolkit.launch.sbatch import sbatch_script
from toolkit.placement.plan import plan

GOLDEN = REPO / "tests" / "golden"
RUN_DIR = "/scratch/my runs/it's \"quoted\""
SLURM = {"python": "/opt/rlhf env/bin/python", "account": "proj-42", "qos": "normal", "time_min": 120,
         "setup": ["module load cuda/12.4", "source '/opt/rlhf env/bin/activate'"], "sbatch": {"mail-type": "END"}}


def check(name: str, text: str) -> None:
    path = GOLDEN / name
    if os.environ.get("UPDATE_GOLDEN"):
        path.write_text(text)
    assert path.exists(), f"{path} is missing; create it with: UPDATE_GOLDEN=1 bash tools/test.sh -k golden"
    expected = path.read_text()
    assert text == expected, (f"output differs from {path}; if the change is intended, regenerate with: "
                              "UPDATE_GOLDEN=1 bash tools/test.sh -k golden")


def configs(tiny, tmp_path):
    one = example("tiny-grpo.yaml", tiny, slurm=SLURM, trainer={"micro_batch_size": 8},
                  placement={"trainer": {"workers": 2, "nodes": 2, "cpus_per_worker": 2, "mem_gb": 16},
                             # (one job: every node gets its --mem, so every group asks for the same)
                             "generator": {"mem_gb": 16}, "scorer": {"mem_gb": 16}})
    het = example("tiny-ppo.yaml", tiny, slurm=SLURM,
                  placement={"generator": {"partition": "gpu-a", "gpus_per_worker": 1, "cpus_per_worker": 8},
                             "scorer": {"partition": "cpu"},
                             "trainer": {"workers": 4, "nodes": 2, "partition": "gpu-h", "gpus_per_worker": 1,
                                         "constraint": "h100", "mem_gb": 480}},
                  trainer={"micro_batch_size": 8, "updates_per_step": 1})
    return {"one": write_config(tmp_path / "one", one), "het": write_config(tmp_path / "het", het)}


@pytest.mark.parametrize("kind", ["one", "het"])
def test_dry_run(kind, tiny, tmp_path):
    result = cli("submit", configs(tiny, tmp_path)[kind], "--dry-run", "--run-dir", RUN_DIR, timeout=60)
    assert result.returncode == 0, result.stderr
    assert not Path(RUN_DIR).exists()  # a dry run writes nothing
    check(f"dry-run-{kind}.txt", result.stdout)


@pytest.mark.parametrize("kind", ["one", "het"])
def test_render(kind, tiny, tmp_path):
    cfg = load_config(configs(tiny, tmp_path)[kind])
    allocation = plan_allocation(plan(cfg), cfg.slurm.heterogeneous)
    script = sbatch_script(cfg, allocation, RUN_DIR, [cfg.slurm.python, "-m", "toolkit.launch.batch", RUN_DIR],
                           how="render")
    check(f"render-{kind}.sbatch", script)


def test_render_writes_the_script_into_a_new_run_dir(tiny, tmp_path):
    run_dir = tmp_path / "a b" / "it's"
    result = cli("render", configs(tiny, tmp_path)["one"], "--run-dir", run_dir, timeout=60)
    assert result.returncode == 0, result.stderr
    script = (run_dir / "slurm" / "job.sbatch").read_text()
    assert "exec '/opt/rlhf env/bin/python' -m toolkit.launch.batch" in script
    assert (run_dir / "config.yaml").exists() and "sbatch '" in result.stdout


def test_render_again_after_a_config_edit_rewrites_the_script_until_the_run_starts(tiny, tmp_path):
    import yaml

    config = configs(tiny, tmp_path)["one"]
    run_dir = tmp_path / "run"
    assert cli("render", config, "--run-dir", run_dir, timeout=60).returncode == 0
    secret = (run_dir / "secret").read_bytes()
    data = yaml.safe_load(config.read_text())
    data["slurm"]["time_min"] = 17
    config.write_text(yaml.safe_dump(data))
    again = cli("render", config, "--run-dir", run_dir, timeout=60)
    assert again.returncode == 0, again.stderr
    assert "#SBATCH --time=17" in (run_dir / "slurm" / "job.sbatch").read_text()
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["slurm"]["time_min"] == 17
    assert (run_dir / "secret").read_bytes() == secret
    (run_dir / "status.json").write_text("{}")  # the job has started: its directory is never rewritten
    refused = cli("render", config, "--run-dir", run_dir, timeout=60)
    assert refused.returncode == 2 and "already holds a run" in refused.stderr


def test_sbatch_extras_ask_every_component_of_a_heterogeneous_job(tiny, tmp_path):
    """`slurm.sbatch: {exclusive: true}` reached only component 0 of a heterogeneous job: the scorers and
    trainers shared their nodes all the same. Options of the whole job (mail) stay in the first component."""
    import yaml

    config = configs(tiny, tmp_path)["het"]
    data = yaml.safe_load(config.read_text())
    data["slurm"]["sbatch"] = {"exclusive": True, "reservation": "r1", "mail-type": "END", "mail-user": "me@x"}
    cfg = load_config(write_config(tmp_path / "extras", data))
    allocation = plan_allocation(plan(cfg), cfg.slurm.heterogeneous)
    script = sbatch_script(cfg, allocation, RUN_DIR, ["true"], how="render")
    blocks = script.split("#SBATCH hetjob")
    assert len(blocks) == 3
    for block in blocks:
        assert "#SBATCH --exclusive\n" in block and "#SBATCH --reservation=r1\n" in block, block
    assert ["--mail-type=END" in b and "--mail-user=me@x" in b for b in blocks] == [True, False, False]
