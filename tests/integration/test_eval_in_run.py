"""Evaluation in the run (`eval.every_steps`): the generators sample the held-out prompts after every N
steps and the last, the run's rewards score them, trainer rank 0 writes them as `slurm-rlhf eval` writes
its files (RUN_DIR/eval/in-run), and nothing is trained on or committed from them; in Separation, in
Flattening over two ranks that generate, and asynchronously."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import cli, example, write_config

pytestmark = pytest.mark.integration


def read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def run(tiny, tmp_path, steps: int, **sections):
    config = write_config(tmp_path, example("tiny-grpo.yaml", tiny, run={"steps": steps, "name": "in-run-eval"},
                                            data={"prompts": str(tiny / "prompts.jsonl"), "eval_fraction": 0.1},
                                            **sections))
    result = cli("run", config, "--run-dir", tmp_path / "run")
    assert result.returncode == 0, result.stdout + result.stderr
    return tmp_path / "run", result.stdout


def test_a_run_evaluates_itself_as_eval_scores_its_checkpoints(tiny, tmp_path):
    """Separation, synchronous, greedy: the evaluations after steps 2 and 4 are, sample for sample, what
    `slurm-rlhf eval` gets from the checkpoints of those steps (the same held-out prompts, weights, and
    vLLM), and the run trains on its own prompts only."""
    run_dir, out = run(tiny, tmp_path, 4, eval={"every_steps": 2}, checkpoint={"every_steps": 2, "keep": 2})
    summary = read(run_dir / "eval" / "in-run" / "summary.jsonl")
    assert [r["step"] for r in summary] == [2, 4]
    assert all(r["policy_version_min"] == r["policy_version_max"] == r["step"] for r in summary)
    assert all(r["n"] == 1 and r["temperature"] == 0 and r["samples"] == r["prompts"] > 0 for r in summary)
    assert [line.split()[:3] for line in out.splitlines() if line.startswith("eval ")] == \
        [["eval", "step", "2"], ["eval", "step", "4"]]
    metrics = read(run_dir / "metrics.jsonl")
    assert [m["samples"] for m in metrics] == [64] * 4  # (the held-out samples are not in any step)
    assert sorted(p.name for p in (run_dir / "experience").glob("*.h5")) == [f"step-{s:06d}.h5" for s in range(4)]
    assert (run_dir / "tensorboard" / "eval-in-run").is_dir()

    result = cli("eval", run_dir)  # the checkpoints of steps 2 and 4, on the same held-out prompts
    assert result.returncode == 0, result.stdout + result.stderr
    after = read(run_dir / "eval" / "heldout" / "summary.jsonl")
    assert [r["step"] for r in after] == [2, 4]
    for r, a in zip(summary, after):
        assert r["reward_mean"] == pytest.approx(a["reward_mean"], abs=1e-6)
        ours, theirs = (read(run_dir / "eval" / name / f"step-{r['step']:06d}.jsonl") for name in ("in-run", "heldout"))
        assert [(s["prompt_id"], s["response"]) for s in ours] == [(s["prompt_id"], s["response"]) for s in theirs]
    assert len({s["response"] for s in ours}) > 1  # (not one response for every prompt)


@pytest.mark.parametrize("case", ["flattening over 2 ranks", "asynchronous"])
def test_evaluations_in_other_placements_sample_n_each_and_train_nothing(tiny, tmp_path, case):
    """Flattening over two trainer ranks that generate with the actor (transformers), and asynchronous
    Separation (max_policy_lag 1): every step is evaluated, with 2 samples a prompt at temperature 1."""
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
