"""The three strategies through `submit` on the real local cluster: each node group is one job step on its
own nodes (or on another group's, `same_nodes_as`), as Slurm itself reports it, and all compute the same
thing (same rewards and losses)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import NamedTuple

import pytest
import yaml

from tests.conftest import cli
from tests.slurm.test_submit import assert_nothing_left, expand, run_config, submit_and_wait

pytestmark = pytest.mark.slurm


class Submitted(NamedTuple):
    workers: dict  # status.json's workers
    records: list[dict]  # metrics.jsonl
    run_dir: Path
    steps: dict  # Slurm's own record of each role's job step: {role: (step id, node list)}
    stdout: str


def submitted(tiny, tmp_path, strategy: str, groups: dict, env: dict | None = None) -> Submitted:
    config = run_config(tiny, tmp_path / strategy,
                        rollout={"backend": "hf", "prompts_per_step": 16, "group_size": 4, "max_new_tokens": 24},
                        placement={"strategy": strategy, **groups})
    data = yaml.safe_load(config.read_text())
    data["run"].update(seed=2, deterministic=True, name=strategy)
    config.write_text(yaml.safe_dump(data))
    run_dir = tmp_path / f"{strategy}'s run"  # (a quote in the path)
    result, steps = submit_and_wait(config, run_dir, env)
    assert result.returncode == 0, result.stdout + result.stderr
    status = json.loads((run_dir / "status.json").read_text())
    assert status["state"] == "finished" and status["launcher"] == "slurm"
    assert_nothing_left(run_dir, str(json.loads((run_dir / "job.json").read_text())["job_id"]))
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["policy_version"] for r in records] == [1, 2, 3]
    return Submitted(status["workers"], records, run_dir, steps, result.stdout)


def nodes_of(workers: dict, group: str) -> set[str]:
    return {e["node"] for w, e in workers.items() if w.startswith(group + ":")}


def assert_each_role_in_a_job_step_of_its_own(run: Submitted, planned: dict[str, tuple[int, int]]) -> None:
    """What ran where, as Slurm saw it while the run went on (squeue's job steps) and as each worker
    recorded it (SLURMD_NODENAME): `planned` {role: (nodes, workers)}, disjoint node sets covering the
    allocation. And what `submit --wait` and `status` say of it."""
    seen_by_slurm = {}
    for role, (count, workers) in planned.items():
        step, nodelist = run.steps[role]
        nodes = expand(nodelist)
        assert len(nodes) == count, (role, nodes)
        seen_by_slurm[role] = set(nodes)
        # every worker of the role ran inside that step, on one of its nodes
        ran = {w: e for w, e in run.workers.items() if w.startswith(role + ":")}
        assert len(ran) == workers, (role, sorted(ran))
        assert {e["slurm_step"] for e in ran.values()} == {step}
        assert {e["node"] for e in ran.values()} == set(nodes)
    all_nodes = [n for nodes in seen_by_slurm.values() for n in nodes]
    assert len(all_nodes) == len(set(all_nodes)) == 4
    assert "submitted slurm job" in run.stdout and "step   3/3" in run.stdout
    job_id = json.loads((run.run_dir / "job.json").read_text())["job_id"]
    text = cli("status", run.run_dir, timeout=60).stdout
    assert f"slurm job {job_id}: COMPLETED" in text and "run state: finished, steps done: 3/3" in text


def test_three_strategies_on_slurm(tiny, tmp_path):
    flat = submitted(tiny, tmp_path, "flattening", {"all": {"workers": 2, "nodes": 2}})
    assert sorted(flat.workers) == ["all:0", "all:1"] and len(nodes_of(flat.workers, "all")) == 2
    inter = submitted(tiny, tmp_path, "interleaving", {"trainer": {"workers": 2, "nodes": 2}, "scorer": {"nodes": 1}})
    trainer, scorer = nodes_of(inter.workers, "trainer"), nodes_of(inter.workers, "scorer")
    assert len(trainer) == 2 and len(scorer) == 1 and not trainer & scorer  # disjoint node groups
    steps = {e["slurm_step"] for w, e in inter.workers.items()}
    assert len(steps) == 2  # one job step per node group
    sep = submitted(tiny, tmp_path, "separation", {"generator": {"workers": 2, "nodes": 1},
                                                   "trainer": {"workers": 2, "nodes": 2}})
    assert_each_role_in_a_job_step_of_its_own(sep, {"generator": (1, 2), "scorer": (1, 1), "trainer": (2, 2)})
    assert all(r["behaviour_logprob_diff"] < 1e-4 for r in sep.records)  # (weights broadcast to the generators)
    # OpenRLHF's layout: the generators on the trainer's nodes, each job step taking only its own CPUs, and,
    # in a job with memory per node (a cluster's DefMemPerNode; here sbatch's SBATCH_MEM_PER_NODE), its share
    # of the memory: a step that asks for none takes all of it where Slurm counts memory (the local cluster
    # does, CR_CPU_Memory), and the trainer's step waited for the generator's until start-up timed out
    shared = submitted(tiny, tmp_path / "shared", "separation", {
        "generator": {"workers": 2, "nodes": 2, "same_nodes_as": "trainer"}, "trainer": {"workers": 2, "nodes": 2}},
        env={"SBATCH_MEM_PER_NODE": "3000"})
    generator, trainer = nodes_of(shared.workers, "generator"), nodes_of(shared.workers, "trainer")
    assert len(trainer) == 2 and generator == trainer and not nodes_of(shared.workers, "scorer") & trainer
    assert len({e["slurm_step"] for e in shared.workers.values()}) == 3
    for group in ("generator", "trainer"):
        assert "--exact --mem=1500M" in (shared.run_dir / "logs" / f"srun-{group}.log").read_text()
    # All give two generating ranks of 8 prompts each and two trainer ranks: the same samples and updates.
    for other in (inter, sep, shared):
        for a, b in zip(flat.records, other.records, strict=True):
            for key in ("reward_mean", "loss", "kl"):
                assert abs(a[key] - b[key]) <= 1e-6, (a["step"], key, a[key], b[key])
