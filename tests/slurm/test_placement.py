"""The three strategies through `submit` on the real local cluster: each node group is one job step on its
own nodes (or on another group's, `same_nodes_as`), and all compute the same thing (same rewards and losses)."""

from __future__ import annotations

import json

import pytest
import yaml

from tests.slurm.test_submit import assert_nothing_left, run_config, submit_and_wait

pytestmark = pytest.mark.slurm


def submitted(tiny, tmp_path, strategy: str, groups: dict) -> tuple[dict, list[dict]]:
    config = run_config(tiny, tmp_path / strategy,
                        rollout={"backend": "hf", "prompts_per_step": 16, "group_size": 4, "max_new_tokens": 24},
                        placement={"strategy": strategy, **groups})
    data = yaml.safe_load(config.read_text())
    data["run"].update(seed=2, deterministic=True, name=strategy)
    config.write_text(yaml.safe_dump(data))
    run_dir = tmp_path / f"{strategy}-run"
    result, _ = submit_and_wait(config, run_dir)
    assert result.returncode == 0, result.stdout + result.stderr
    status = json.loads((run_dir / "status.json").read_text())
    assert status["state"] == "finished" and status["launcher"] == "slurm"
    assert_nothing_left(run_dir, str(json.loads((run_dir / "job.json").read_text())["job_id"]))
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return status["workers"], records


def nodes_of(workers: dict, group: str) -> set[str]:
    return {e["node"] for w, e in workers.items() if w.startswith(group + ":")}


def test_three_strategies_on_slurm(tiny, tmp_path):
    flat_workers, flat = submitted(tiny, tmp_path, "flattening", {"all": {"workers": 2, "nodes": 2}})
    assert sorted(flat_workers) == ["all:0", "all:1"] and len(nodes_of(flat_workers, "all")) == 2
    inter_workers, inter = submitted(tiny, tmp_path, "interleaving",
                                     {"trainer": {"workers": 2, "nodes": 2}, "scorer": {"nodes": 1}})
    trainer, scorer = nodes_of(inter_workers, "trainer"), nodes_of(inter_workers, "scorer")
    assert len(trainer) == 2 and len(scorer) == 1 and not trainer & scorer  # disjoint node groups
    steps = {e["slurm_step"] for w, e in inter_workers.items()}
    assert len(steps) == 2  # one job step per node group
    sep_workers, sep = submitted(tiny, tmp_path, "separation", {"generator": {"workers": 2, "nodes": 1},
                                                                 "trainer": {"workers": 2, "nodes": 2}})
    groups = [nodes_of(sep_workers, g) for g in ("generator", "scorer", "trainer")]
    assert [len(g) for g in groups] == [1, 1, 2] and len(set.union(*groups)) == 4  # disjoint node groups
    # OpenRLHF's layout: the generators on the trainer's nodes, each job step taking only its own CPUs
    shared_workers, shared = submitted(tiny, tmp_path / "shared", "separation", {
        "generator": {"workers": 2, "nodes": 2, "same_nodes_as": "trainer"}, "trainer": {"workers": 2, "nodes": 2}})
    generator, trainer = nodes_of(shared_workers, "generator"), nodes_of(shared_workers, "trainer")
    assert len(trainer) == 2 and generator == trainer and not nodes_of(shared_workers, "scorer") & trainer
    assert len({e["slurm_step"] for e in shared_workers.values()}) == 3
    # All give two generating ranks of 8 prompts each and two trainer ranks: the same samples and updates.
    for other in (inter, sep, shared):
        for a, b in zip(flat, other, strict=True):
            for key in ("reward_mean", "loss", "kl"):
                assert abs(a[key] - b[key]) <= 1e-6, (a["step"], key, a[key], b[key])
