"""Evaluation in the run (`eval.every_steps`): the generators sample the held-out prompts after every N
steps and the last, the run's rewards score them, trainer rank 0 writes them as `slurm-rlhf eval` writes
its files (RUN_DIR/eval/in-run), and nothing is trained on or committed from them; in Separation, in
Flattening over two ranks that generate, and asynchronously. An evaluation cut short by a generator that
died, or by the end of the whole run (a crash), is made again, as it would have been."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from tests.conftest import alive, cli, example, killed_at_exit, run_and_kill, start_held, wandb_history, write_config
from toolkit.training.engine import SHARD_ALL_ENV

pytestmark = pytest.mark.integration
SECTIONS = {"run": {"steps": 4, "name": "in-run-eval", "seed": 5, "deterministic": True},
            "eval": {"every_steps": 2}, "checkpoint": {"every_steps": 2, "keep": 2}}
WANDB = {"project": "in-run-eval", "mode": "offline"}


def read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def config(tiny, tmp_path, steps: int = 4, **sections) -> Path:
    sections = {**SECTIONS, **sections}
    sections["run"] = {**sections["run"], "steps": steps}
    data = {"prompts": str(tiny / "prompts.jsonl"), "eval_fraction": 0.1, **sections.pop("data", {})}
    return write_config(tmp_path, example("tiny-grpo.yaml", tiny, **sections, data=data))


def run(tiny, tmp_path, steps: int, env: dict | None = None, **sections):
    result = cli("run", config(tiny, tmp_path, steps, **sections), "--run-dir", tmp_path / "run", env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    return tmp_path / "run", result.stdout


@pytest.fixture(scope="module")
def evaluated(tiny, tmp_path_factory):
    """A deterministic run of 4 steps in Separation, evaluated greedily after steps 2 and 4, with
    checkpoints of both and W&B offline: (its directory, its output)."""
    return run(tiny, tmp_path_factory.mktemp("evaluated"), 4, wandb=WANDB)


def assert_evaluations_in_wandb(run_dir: Path, rows: dict[int, int]) -> None:
    """The W&B run of the last attempt has each evaluation of eval/in-run/summary.jsonl, in the row of
    `rows[its step]`, once, with its numbers."""
    history = wandb_history(run_dir)[-1]
    found = {row["eval/step"]: row for row in history if "eval/step" in row}
    summary = read(run_dir / "eval" / "in-run" / "summary.jsonl")
    assert {e: row["_step"] for e, row in found.items()} == rows
    assert sum("eval/step" in row for row in history) == len(rows)
    for r in summary:
        for name in ("reward_mean", "reward_std", "response_len_mean", "finished_frac"):
            assert found[r["step"]][f"eval/{name}"] == pytest.approx(r[name], rel=1e-6), name


def assert_same_evaluations(run_dir: Path, other: Path, steps=(2, 4)) -> None:
    """The in-run evaluations of two runs (of `steps`): the same weights, samples and rewards."""
    ours, theirs = (read(d / "eval" / "in-run" / "summary.jsonl") for d in (run_dir, other))
    theirs = [t for t in theirs if t["step"] in steps]
    assert [r["step"] for r in ours] == [t["step"] for t in theirs] == list(steps)
    for r, t in zip(ours, theirs):
        assert r["policy_version_min"] == r["policy_version_max"] == r["step"]
        assert r["reward_mean"] == pytest.approx(t["reward_mean"], abs=1e-6) and r["samples"] == t["samples"]
        a, b = (read(d / "eval" / "in-run" / f"step-{r['step']:06d}.jsonl") for d in (run_dir, other))
        key = lambda s: (s["prompt_id"], s["sample"], s["response"], round(s["reward"], 6))  # noqa: E731
        assert sorted(map(key, a)) == sorted(map(key, b))
    assert [m["reward_mean"] for m in read(run_dir / "metrics.jsonl")] == \
        [m["reward_mean"] for m in read(other / "metrics.jsonl")]


def test_a_run_evaluates_itself_as_eval_scores_its_checkpoints(evaluated):
    """Separation, synchronous, greedy: the evaluations after steps 2 and 4 are, sample for sample, what
    `slurm-rlhf eval` gets from the checkpoints of those steps (the same held-out prompts, weights, and
    vLLM), and the run trains on its own prompts only."""
    run_dir, out = evaluated
    summary = read(run_dir / "eval" / "in-run" / "summary.jsonl")
    assert [r["step"] for r in summary] == [2, 4]
    assert all(r["policy_version_min"] == r["policy_version_max"] == r["step"] for r in summary)
    assert all(r["n"] == 1 and r["temperature"] == 0 and r["samples"] == r["prompts"] > 0 for r in summary)
    assert [line.split()[:3] for line in out.splitlines() if line.startswith("eval ")] == \
        [["eval", "step", "2"], ["eval", "step", "4"]]
    metrics = read(run_dir / "metrics.jsonl")
    assert [m["samples"] for m in metrics] == [64] * 4  # (the held-out samples are not in any step)
    # the step after an evaluation carries it (its generators sampled the held-out prompts first), and says
    # how much of its wall time that was
    assert ["eval_wall_s" in m for m in metrics] == [False, False, True, False]
    assert 0 < metrics[2]["eval_wall_s"] < metrics[2]["step_s"]
    assert sorted(p.name for p in (run_dir / "experience").glob("*.h5")) == [f"step-{s:06d}.h5" for s in range(4)]
    assert (run_dir / "tensorboard" / "eval-in-run").is_dir()
    # in W&B, in the row of the step that made the weights (the rows are the steps trained)
    assert_evaluations_in_wandb(run_dir, {2: 2, 4: 4})
    status = cli("status", run_dir, timeout=60).stdout
    assert f"eval in-run: step 4 reward {summary[-1]['reward_mean']:+.4f} (2 evaluation(s) in the run;" in status

    result = cli("eval", run_dir)  # the checkpoints of steps 2 and 4, on the same held-out prompts
    assert result.returncode == 0, result.stdout + result.stderr
    after = read(run_dir / "eval" / "heldout" / "summary.jsonl")
    assert [r["step"] for r in after] == [2, 4]
    for r, a in zip(summary, after):
        assert r["reward_mean"] == pytest.approx(a["reward_mean"], abs=1e-6)
        ours, theirs = (read(run_dir / "eval" / name / f"step-{r['step']:06d}.jsonl") for name in ("in-run", "heldout"))
        assert [(s["prompt_id"], s["response"]) for s in ours] == [(s["prompt_id"], s["response"]) for s in theirs]
    assert len({s["response"] for s in ours}) > 1  # (not one response for every prompt)


def test_an_evaluation_lost_with_its_generator_is_made_again(evaluated, tiny, tmp_path):
    """The generator is killed (SIGKILL) as it takes the held-out prompts of step 2's evaluation: the driver
    starts it again, the trainer says which held-out prompts it misses (all), they go out again ahead of
    step 2's prompts, and the run ends with the evaluations and steps of the run that was not killed."""
    proc, pid = start_held(config(tiny, tmp_path), tmp_path / "run", "evaluating")
    with killed_at_exit(proc):
        os.kill(pid, signal.SIGKILL)
        out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out
    assert not alive([pid])
    assert "starting it again alone" in out
    prompts = read(evaluated[0] / "eval" / "in-run" / "summary.jsonl")[0]["prompts"]
    assert f"sending {prompts} of the {prompts} held-out prompts of the evaluation of step 2 again" in out, out
    assert_same_evaluations(tmp_path / "run", evaluated[0])


@pytest.mark.parametrize("nth", [1, 2], ids=["a middle evaluation", "the last evaluation"])
def test_an_evaluation_cut_short_by_a_crash_is_made_on_resume(evaluated, tiny, tmp_path, nth):
    """The whole run is killed (SIGKILL, every process) while its generator holds the held-out prompts of
    the evaluation of step 2 (or of step 4, the last: every step is trained by then): `resume` finds no
    line of that evaluation and makes it first, with the resumed weights, which are those it was sent for.
    One of earlier weights that is missing (step 2's line, removed in the second case) is named. The
    W&B run of the resume has each evaluation there is, once, in the row of the step that made its weights
    (the killed attempt's W&B rows are lost: the resume sends the steps again, with their evaluations)."""
    run_dir = tmp_path / "run"
    run_and_kill(config(tiny, tmp_path, wandb=WANDB), run_dir, hold=f"evaluating@{nth}")
    step = 2 * nth
    summary = run_dir / "eval" / "in-run" / "summary.jsonl"
    assert [r["step"] for r in read(summary)] == [2] if nth == 2 else not summary.exists()
    if nth == 2:
        summary.unlink()  # (as if step 2's evaluation had been cut short too)
    result = cli("resume", run_dir)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"evaluating step {step} again: the run stopped before its evaluation was written" in result.stdout
    lost = "the evaluation of step(s) 2 did not finish before the run stopped and its weights are gone"
    assert (lost in result.stdout) == (nth == 2), result.stdout
    assert_same_evaluations(run_dir, evaluated[0], steps=(2, 4) if nth == 1 else (4,))
    assert_evaluations_in_wandb(run_dir, {2: 2, 4: 4} if nth == 1 else {4: 4})


@pytest.mark.parametrize("case", ["flattening over 2 ranks", "asynchronous"])
def test_evaluations_in_other_placements_sample_n_each_and_train_nothing(tiny, tmp_path, case):
    """Flattening over two trainer ranks, each with a vLLM engine of its own (`rollout.backend: auto`), and
    asynchronous Separation (max_policy_lag 1): every step is evaluated, with 2 samples a prompt at
    temperature 1. (The reward-model test below evaluates with the actor itself, transformers.)"""
    sections = ({"placement": {"strategy": "flattening", "all": {"workers": 2}}} if case.startswith("flattening")
                else {"rollout": {"max_policy_lag": 1}})
    run_dir, out = run(tiny, tmp_path, 3, eval={"every_steps": 1, "n": 2, "temperature": 1.0}, **sections)
    summary = read(run_dir / "eval" / "in-run" / "summary.jsonl")
    assert [r["step"] for r in summary] == [1, 2, 3]
    for r in summary:
        assert r["samples"] == 2 * r["prompts"] and r["prompts"] > 0
        assert r["reward_best_of_n_mean"] >= r["reward_mean"] - 1e-9  # (the better of each prompt's two)
        assert 1 <= r["policy_version_min"] <= r["policy_version_max"] <= 3
        samples = read(run_dir / "eval" / "in-run" / f"step-{r['step']:06d}.jsonl")
        assert sorted((s["prompt_id"], s["sample"]) for s in samples) == \
            sorted((p, k) for p in {s["prompt_id"] for s in samples} for k in (0, 1))
    assert [m["samples"] for m in read(run_dir / "metrics.jsonl")] == [64] * 3
    assert out.count("\neval step") == 3 and "best of 2" in out
    if case.startswith("flattening"):
        for rank in (0, 1):
            log = (run_dir / "logs" / f"all-{rank}.log").read_text()
            assert "generating with vLLM in the trainer's process" in log, rank


def test_reward_models_on_the_trainer_ranks_score_the_evaluations(tiny, tmp_path):
    """Flattening over two ranks under ZeRO-3, with a reward model beside the actor: the ranks score the
    training steps' samples each its shard, the reward model sharded over them (`deferred`), and so the
    evaluations' too, at rank 0's word. 7 held-out prompt rows: shards of 4 and 3, 2 and 1 forward passes of
    3 (each a ZeRO-3 gather of every layer with the other rank), which the ranks even out. The reward
    model's scores are those `slurm-rlhf eval` gives the same responses from the checkpoints (one process,
    the whole reward model)."""
    rm = {"path": str(tiny / "reward_model"), "name": "tiny_rm", "weight": 0.5}
    run_dir, out = run(tiny, tmp_path, 2, run={"name": "in-run-eval", "seed": 1, "deterministic": True},
                       eval={"every_steps": 1}, checkpoint={"every_steps": 1, "keep": 2}, data={"eval_fraction": 0.05},
                       placement={"strategy": "flattening", "all": {"workers": 2}}, trainer={"zero_stage": 3},
                       reward={"functions": [{"function": "toolkit.rewards.examples:digit_ratio", "weight": 1.0}],
                               "models": [rm]}, rollout={"backend": "hf"}, model={"forward_batch_size": 3},
                       env={SHARD_ALL_ENV: "1"})  # (every parameter sharded: each pass gathers from both ranks)
    summary = read(run_dir / "eval" / "in-run" / "summary.jsonl")
    assert [(r["step"], r["prompts"], r["policy_version_min"], r["policy_version_max"]) for r in summary] == \
        [(1, 7, 1, 1), (2, 7, 2, 2)]
    assert out.count("\neval step") == 2 and "tiny_rm" in out
    assert [m["reward_ranks"] for m in read(run_dir / "metrics.jsonl")] == [2, 2]  # (the steps' scoring: deferred)

    result = cli("eval", run_dir, "--backend", "hf")
    assert result.returncode == 0, result.stdout + result.stderr
    same = 0
    for step in (1, 2):
        ours, theirs = (read(run_dir / "eval" / name / f"step-{step:06d}.jsonl") for name in ("in-run", "heldout"))
        assert len(ours) == len(theirs) == 7
        assert all(abs(s["reward/tiny_rm"]) > 0 for s in ours)  # (filled in, not the scorer's empty column)
        theirs = {(s["prompt_id"], s["response"]): s for s in theirs}
        for s in ours:
            t = theirs.get((s["prompt_id"], s["response"]))
            if t is not None:  # (greedy; two ranks' batches may still break a near tie otherwise)
                same += 1
                assert s["reward/tiny_rm"] == pytest.approx(t["reward/tiny_rm"], abs=1e-4), s["prompt_id"]
                assert s["reward"] == pytest.approx(t["reward"], abs=1e-4)
    assert same >= 12, same  # (of 14)
