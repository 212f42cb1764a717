"""Placement strategies end to end: the placement changes where things run, not what is computed.

Same workload, same seed, deterministic mode, transformers generation everywhere (a generator that shares
a worker with the trainer generates with the trainer's actor; vLLM and transformers sample differently),
and the same prompts per engine call: then every strategy gives the same per-step rewards and losses.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.conftest import cli, example, experience_commits, run_and_kill, write_config

pytestmark = pytest.mark.integration
TOLERANCE = 1e-6  # observed: bitwise equal


def run(tiny, tmp_path: Path, name: str, algorithm: str, **sections) -> list[dict]:
    data = example(f"tiny-{algorithm}.yaml", tiny, **sections)
    data["run"].update(steps=3, seed=5, deterministic=True, name=name)
    data["rollout"]["backend"] = "hf"
    run_dir = tmp_path / name
    result = cli("run", write_config(tmp_path / f"{name}-config", data), "--run-dir", run_dir)
    assert result.returncode == 0, result.stdout + result.stderr
    status = json.loads((run_dir / "status.json").read_text())
    assert status["state"] == "finished"
    workers = sorted(status["workers"])
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["policy_version"] for r in records] == [1, 2, 3]
    return workers, records


def assert_same(a: list[dict], b: list[dict], what: str) -> None:
    for ra, rb in zip(a, b, strict=True):
        for key in ("reward_mean", "loss", "kl", "response_tokens"):
            assert abs(ra[key] - rb[key]) <= TOLERANCE, f"{what}: step {ra['step']} {key} {ra[key]} vs {rb[key]}"


def interleaving_config(tiny, directory: Path, name: str) -> Path:
    """6 steps of `run`'s workload under Interleaving, a checkpoint every 2 steps."""
    data = example("tiny-grpo.yaml", tiny, placement={"strategy": "interleaving"}, checkpoint={"every_steps": 2},
                   run={"steps": 6, "seed": 5, "deterministic": True, "name": name})
    data["rollout"]["backend"] = "hf"
    return write_config(directory / f"{name}-config", data)


@pytest.fixture(scope="module")
def interleaving_whole(tiny, tmp_path_factory) -> Path:
    """An uninterrupted `interleaving_config` run. Its first 3 steps are also the Interleaving run that
    test_three_strategies compares: the learning rate is constant, so they do not depend on the run's length."""
    run_dir = tmp_path_factory.mktemp("interleaving") / "whole"
    result = cli("run", interleaving_config(tiny, run_dir.parent, "whole"), "--run-dir", run_dir)
    assert result.returncode == 0, result.stdout + result.stderr
    return run_dir


def test_three_strategies_same_rewards_and_losses(tiny, interleaving_whole, tmp_path):
    # (Flattening with offload: the trainer's optimizer states, master weights and gradients go to host
    # memory between updates, while the generator runs; here on CPU the calls run and move nothing. Its one
    # worker also spins before its OpenMP threads sleep, run.openmp_spin, which changes no number.)
    results = {s: run(tiny, tmp_path, s, "grpo", placement={"strategy": s, "offload": s == "flattening"},
                      run={"openmp_spin": 3000} if s == "flattening" else {})
               for s in ("separation", "flattening")}
    status = json.loads((interleaving_whole / "status.json").read_text())
    interleaved = [json.loads(line) for line in (interleaving_whole / "metrics.jsonl").read_text().splitlines()]
    results["interleaving"] = sorted(status["workers"]), interleaved[:3]
    assert results["separation"][0] == ["generator:0", "scorer:0", "trainer:0"]
    assert results["flattening"][0] == ["all:0"]
    assert results["interleaving"][0] == ["scorer:0", "trainer:0"]
    base = results["separation"][1]
    assert len({r["reward_mean"] for r in base}) > 1  # the policy moved between steps
    for strategy in ("flattening", "interleaving"):
        assert_same(base, results[strategy][1], strategy)
    policy, spin = os.environ.get("OMP_WAIT_POLICY", "PASSIVE"), os.environ.get("GOMP_SPINCOUNT")  # (theirs win)
    waits = f"OpenMP threads wait: OMP_WAIT_POLICY={policy}"
    for name, line in (("separation/logs/trainer-0.log", f"{waits}, GOMP_SPINCOUNT={spin} " if spin else f"{waits}\n"),
                       ("flattening/logs/all-0.log", f"{waits}, GOMP_SPINCOUNT={spin or 3000} (each spins")):
        assert line in (tmp_path / name).read_text(), name
    parked = [r.get("park_s") for r in results["flattening"][1]]
    assert all(s is not None and s > 0 for s in parked[:-1]) and parked[-1] is None, parked  # (not after the last)
    # (here nothing moves, and DeepSpeed's full gc.collect in it, 0.5-1.8 s a step, leaves out what exists)
    assert all(s < 0.2 for s in parked[:-1]), parked
    # (parking is a phase of the worker's own, in `status` and the report's timeline: it was `idle`, drawn as a wait)
    phases = [json.loads(line) for line in (tmp_path / "flattening/timeline/all-0.jsonl").read_text().splitlines()]
    spans = [(a["step"], b["t"] - a["t"]) for a, b in zip(phases, phases[1:]) if a["phase"] == "parking"]
    assert [step for step, _ in spans] == [0, 1], phases
    assert all(seconds >= s - 1e-3 for (_, seconds), s in zip(spans, parked)), (spans, parked)
    assert all("park_s" not in r for r in results["interleaving"][1])


def test_ppo_zero3_two_ranks_colocated_and_apart(tiny, tmp_path):
    """PPO under ZeRO-3 on two trainer ranks: generators and scorers of their own (weights by broadcast)
    against the reference and reward model with the trainer (`colocate_all_models`) and against every
    model on the two ranks (Flattening: rank 1 generates, then follows rank 0; weights copied in memory).
    A scoring model beside the trainer is scored by each rank for its own shard of the step, with its half
    of the model."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    common = {"trainer": {"zero_stage": 3, "micro_batch_size": 8, "lr": 0.001}}
    _, apart = run(tiny, tmp_path, "apart", "ppo", placement={"generator": {"workers": 2}, "trainer": {"workers": 2}},
                   **common)
    assert all("reference_ranks" not in r and "reward_ranks" not in r for r in apart)
    models = ((AutoModelForCausalLM.from_pretrained(tiny / "model"), "reference_parameters"),
              (AutoModelForSequenceClassification.from_pretrained(tiny / "reward_model", num_labels=1),
               "reward_model_parameters"))
    for name, placement, expected in (
            ("all-models", {"strategy": "colocate_all_models", "generator": {"workers": 2}, "trainer": {"workers": 2}},
             ["generator:0", "generator:1", "trainer:0", "trainer:1"]),
            ("flat", {"strategy": "flattening", "all": {"workers": 2}}, ["all:0", "all:1"])):
        workers, records = run(tiny, tmp_path, name, "ppo", placement=placement, **common)
        assert workers == expected
        assert_same(apart, records, name)
        for a, b in zip(apart, records):  # the reward model's column, scored in two halves, summed over ranks
            assert abs(a["reward/tiny_rm"] - b["reward/tiny_rm"]) <= TOLERANCE, (name, a["reward/tiny_rm"],
                                                                                 b["reward/tiny_rm"])
        assert [(r.get("reference_ranks"), r.get("reward_ranks")) for r in records] == [(2, 2)] * 3, name
        assert all(r["score_s"] > 0 for r in records)
        # Under ZeRO-3 those models are sharded over the two ranks too: each holds half of each (each
        # tensor's partition is padded to a multiple of the ranks).
        status = json.loads((tmp_path / name / "status.json").read_text())["workers"]
        for model, key in models:
            tensors = list(model.parameters())
            total = sum(p.numel() for p in tensors)
            held = [w[key] for _, w in sorted(status.items()) if key in w]
            assert len(held) == 2 and all(0 <= 2 * h - total <= len(tensors) for h in held), (name, key, held, total)


@pytest.mark.parametrize("zero_stage", [2, 3])
def test_ppo_critic_on_ranks_of_its_own_trains_as_beside_the_actor_and_resumes(tiny, tmp_path, zero_stage):
    """The critic in a node group of its own (OpenRLHF's actor and critic on GPUs of their own), as the
    planner lays it out: vLLM's group, the actor's two ranks with the reference and reward model (which
    score each rank's shard there), and two critic ranks, each paired with an actor rank's shard of the
    step. Killed after its third commit and resumed (the critic's ranks train again on the committed
    values and returns too), it ends with the per-step results of an uninterrupted run with the critic on
    the actor's two ranks (`colocate_all_models`). Under ZeRO-3 each model is sharded over its own two
    ranks (the actor's part also shards the reference and reward model)."""
    from safetensors.torch import load_file

    def config(name: str, placement: dict) -> Path:
        data = example("tiny-ppo.yaml", tiny, placement=placement, checkpoint={"every_steps": 2},
                       run={"steps": 4, "seed": 5, "deterministic": True, "name": name},
                       trainer={"zero_stage": zero_stage, "micro_batch_size": 8})
        data["rollout"]["backend"] = "hf"
        return write_config(tmp_path / f"{name}-config", data)

    beside = tmp_path / "beside"
    result = cli("run", config("beside", {"strategy": "colocate_all_models", "trainer": {"workers": 2}}),
                 "--run-dir", beside)
    assert result.returncode == 0, result.stdout + result.stderr
    apart = config("apart", {"strategy": "custom", "generator": {"models": ["generation"]},
                             "trainer": {"models": ["actor", "reference", "reward"], "workers": 2},
                             "critic": {"models": ["critic"], "workers": 2}})
    killed = tmp_path / "killed"
    run_and_kill(apart, killed, after_commits=3)
    assert 3 <= experience_commits(killed) < 4
    result = cli("resume", killed)
    assert result.returncode == 0, result.stdout + result.stderr
    status = json.loads((killed / "status.json").read_text())
    assert sorted(status["workers"]) == ["critic:0", "critic:1", "generator:0", "trainer:0", "trainer:1"]
    records = [[json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()] for d in (beside, killed)]
    assert [r["step"] for r in records[1]] == [0, 1, 2, 3]
    # the reward model scored on the actor's two ranks, not on the critic's
    assert all(r["reward_ranks"] == 2 for r in records[0]) and records[1][0]["reward_ranks"] == 2
    for a, b in zip(*records, strict=True):
        for key in ("reward_mean", "loss", "kl", "value_loss", "value_mean", "return_mean", "advantage_std"):
            assert abs(a[key] - b[key]) <= TOLERANCE, f"step {a['step']} {key}: {a[key]} vs {b[key]}"
    assert len({r["value_loss"] for r in records[0]}) == 4  # (the critic learned)
    a, b = (load_file(d / "checkpoints" / "step-000004" / "hf" / "model.safetensors") for d in (beside, killed))
    assert max((a[k] - b[k]).abs().max().item() for k in a) <= 1e-6
    # each model's DeepSpeed checkpoint, with the optimizer state of each of its two ranks
    for model in ("actor", "critic"):
        files = sorted(p.name for p in (killed / "checkpoints" / "step-000004" / model / "ds").iterdir())
        assert [f for f in files if f.endswith("_optim_states.pt")] == \
            [f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in (0, 1)], (model, files)


def test_interleaving_resumes_exactly_after_sigkill(tiny, interleaving_whole, tmp_path):
    """A colocated placement (generation in the trainer's worker, weights never broadcast) killed after
    4 of 6 commits and resumed ends with the uninterrupted run's weights and rewards."""
    from safetensors.torch import load_file

    whole, killed = interleaving_whole, tmp_path / "killed"
    run_and_kill(interleaving_config(tiny, tmp_path, "killed"), killed, after_commits=4)
    assert 4 <= experience_commits(killed) < 6
    result = cli("resume", killed)
    assert result.returncode == 0, result.stdout + result.stderr
    a, b = (load_file(d / "checkpoints" / "step-000006" / "hf" / "model.safetensors") for d in (whole, killed))
    assert max((a[k] - b[k]).abs().max().item() for k in a) <= 1e-6
    rewards = [[json.loads(line)["reward_mean"] for line in (d / "metrics.jsonl").read_text().splitlines()]
               for d in (whole, killed)]
    assert len(rewards[0]) == 6 and rewards[0] == rewards[1]


def test_flattening_over_two_ranks_runs_vllm_in_each_as_a_generator_of_its_own_would(tiny, tmp_path):
    """rollout.backend vllm with Flattening over 2 ranks under ZeRO-3: each rank's process runs a vLLM engine
    of its own for its half of the prompts and, after each update, takes the weights gathered from both
    ranks' shards. The samples end at different lengths (end of sequence at 1/8 a token), so the two
    engines run different numbers of decode steps. Rewards, losses and tokens are those of Separation with
    a vLLM generator of its own."""
    from tests.conftest import assert_clean_logs
    from toolkit.tiny import with_eos_rate

    model = with_eos_rate(tiny, tmp_path / "model-eos", 1 / 8)
    records = {}
    for name, sections in (("apart", {}), ("flat", {"placement": {"strategy": "flattening", "all": {"workers": 2}},
                                                    "trainer": {"zero_stage": 3}})):
        data = example("tiny-grpo.yaml", tiny, run={"steps": 3, "seed": 5, "deterministic": True, "name": name},
                       model={"actor": str(model)}, **sections)
        data["rollout"]["backend"] = "vllm"
        result = cli("run", write_config(tmp_path / f"{name}-config", data), "--run-dir", tmp_path / name)
        assert result.returncode == 0, result.stdout + result.stderr
        assert_clean_logs(tmp_path / name)
        records[name] = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    assert_same(records["apart"], records["flat"], "flattening over 2 ranks with vLLM in each")
    assert all(r["behaviour_logprob_diff"] < 1e-4 and r["sync_check_diff"] < 1e-4 for r in records["flat"])
    assert all(0.2 < r["finished_frac"] and r["response_tokens"] < 0.9 * 64 * 24 for r in records["flat"])
    for rank in (0, 1):
        log = (tmp_path / "flat" / "logs" / f"all-{rank}.log").read_text()
        assert "generating with vLLM in the trainer's process" in log


def test_flattening_runs_vllm_in_the_trainers_process_and_resumes(tiny, exact_run, tmp_path):
    """rollout.backend vllm with Flattening on one worker: vLLM runs in the trainer's process and takes the
    trainer's weights in memory after each update (checked by the probe), and samples what a generator of
    its own samples (the same weights reach both: the Separation run `exact_run`, whose first 5 steps are
    the same workload; its EMA and W&B change nothing of them). Killed after 3 of 5 commits and resumed
    (the trainer then loads its checkpoint into vLLM before the first step), it ends as the uninterrupted
    run."""
    from safetensors.torch import load_file

    from tests.conftest import assert_clean_logs

    def config(name: str) -> Path:
        data = example("tiny-grpo.yaml", tiny, placement={"strategy": "flattening"}, checkpoint={"every_steps": 2},
                       run={"steps": 5, "seed": 5, "deterministic": True, "name": name})
        data["rollout"]["backend"] = "vllm"
        return write_config(tmp_path / f"{name}-config", data)

    result = cli("run", config("flat"), "--run-dir", tmp_path / "flat")
    assert result.returncode == 0, result.stdout + result.stderr
    records = {name: [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][:5]
               for name, run_dir in (("apart", exact_run), ("flat", tmp_path / "flat"))}
    for run_dir in (exact_run, tmp_path / "flat"):
        assert_clean_logs(run_dir)
    assert_same(records["apart"], records["flat"], "flattening with vLLM in the trainer's process")
    assert all(r["behaviour_logprob_diff"] < 1e-4 and r["sync_check_diff"] < 1e-4 for r in records["flat"])
    log = (tmp_path / "flat" / "logs" / "all-0.log").read_text()
    assert "generating with vLLM in the trainer's process" in log
    from toolkit.launch.allocator import choice
    allocator = choice("auto")[0]
    assert allocator == "system" or f"memory allocator: {allocator}\n" in log
    killed = tmp_path / "killed"
    run_and_kill(config("killed"), killed, after_commits=3)
    assert 3 <= experience_commits(killed) < 5
    result = cli("resume", killed)
    assert result.returncode == 0, result.stdout + result.stderr
    a, b = (load_file(d / "export" / "model.safetensors") for d in (tmp_path / "flat", killed))
    assert max((a[k] - b[k]).abs().max().item() for k in a) <= 1e-6
    resumed = [json.loads(line) for line in (killed / "metrics.jsonl").read_text().splitlines()]
    assert [r["reward_mean"] for r in resumed][-5:] == [r["reward_mean"] for r in records["flat"]]
