"""The supervised stages with real processes (DeepSpeed ranks under the driver): SFT and the reward model
learn, export a model the next stage loads, and a run killed mid-way and resumed ends with the
uninterrupted run's weights; packing computes the same loss without padding; two ranks equal one."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from tests.conftest import assert_clean_logs, cli, killed_at_exit, metric_lines, run_and_kill, write_config

pytestmark = pytest.mark.integration
SPLIT = {"sft": 2, "rm": 4, "rl": 4, "seed": 1234}


def stage_config(tiny, stage: str, **sections) -> dict:
    data = {"stage": stage, "run": {"name": stage, "steps": 12, "seed": 1, "deterministic": True},
            "data": {"sources": [{"path": str(tiny / "pipeline.jsonl")}], "split": SPLIT, "eval_fraction": 0.1},
            "model": {"base": str(tiny / "model")},
            "train": {"lr": 0.002, "batch_size": 32, "micro_batch_size": 8, "max_tokens": 64, "eval_every": 4},
            "checkpoint": {"every_steps": 4}}
    for key, value in sections.items():
        data[key] = {**data.get(key, {}), **value}
    return data


def run_stage(tiny, directory: Path, stage: str, **sections) -> Path:
    config = write_config(directory, stage_config(tiny, stage, **sections))
    result = cli(stage, config, "--run-dir", directory / "run")
    assert result.returncode == 0, result.stdout + result.stderr
    assert_clean_logs(directory / "run")
    return directory / "run"


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(run_dir / "export" / "model.safetensors")


def max_difference(a: Path, b: Path) -> float:
    x, y = weights(a), weights(b)
    assert set(x) == set(y)
    return max((x[k] - y[k]).abs().max().item() for k in x)


@pytest.fixture(scope="module")
def sft_run(tiny, tmp_path_factory) -> Path:
    return run_stage(tiny, tmp_path_factory.mktemp("sft"), "sft")


@pytest.fixture(scope="module")
def rm_run(tiny, tmp_path_factory) -> Path:
    return run_stage(tiny, tmp_path_factory.mktemp("rm"), "rm", run={"steps": 20}, train={"eval_every": 5},
                     checkpoint={"every_steps": 5})


def test_sft_learns_and_exports_a_causal_lm(sft_run):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    rs = records(sft_run)
    assert [r["step"] for r in rs] == list(range(12))
    evals = [r for r in rs if "eval_loss" in r]
    assert [r["step"] for r in evals] == [3, 7, 11]
    assert all(r["eval_s"] > 0 for r in evals) and not any("eval_s" in r for r in rs if r not in evals)
    assert evals[-1]["eval_loss"] < evals[0]["eval_loss"] - 0.05, [r["eval_loss"] for r in evals]
    assert abs(evals[-1]["eval_ppl"] - torch.tensor(evals[-1]["eval_loss"]).exp().item()) < 1e-3
    assert rs[-1]["loss"] < rs[0]["loss"] and rs[0]["tokens"] > 0 and 0 < rs[0]["padding_frac"] < 1
    assert all(0 <= r["cut_rows"] <= 32 for r in rs)  # (of the 32 rows of a step, those train.max_tokens cut)
    status = json.loads((sft_run / "status.json").read_text())
    assert status["state"] == "finished" and status["stage"] == "sft" and status["steps"] == 12
    model = AutoModelForCausalLM.from_pretrained(sft_run / "export")  # what the next stage reads
    tokenizer = AutoTokenizer.from_pretrained(sft_run / "export")
    out = model.generate(**tokenizer("Write about stars:", return_tensors="pt"), max_new_tokens=5, do_sample=False)
    assert out.shape[1] > 5


def test_sft_killed_and_resumed_equals_an_uninterrupted_run(tiny, sft_run, tmp_path):
    config = write_config(tmp_path, stage_config(tiny, "sft"))
    run_dir = tmp_path / "run"
    # in step 7, after the checkpoint of step 4 and two more steps: those two are trained again
    run_and_kill(config, run_dir, hold="training@7", until=lambda: metric_lines(run_dir) >= 6)
    assert metric_lines(run_dir) == 6 and not (run_dir / "export").exists()
    result = cli("resume", run_dir)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "resuming after step 4: checkpoint checkpoints/step-000004 (step 4)" in result.stdout, result.stdout
    assert max_difference(run_dir, sft_run) <= 1e-6
    assert [r["loss"] for r in records(run_dir)] == [r["loss"] for r in records(sft_run)]
    assert [r["step"] for r in records(run_dir)] == list(range(12))  # no step twice in the metrics


def test_a_stage_sized_by_epochs_trains_on_when_they_are_raised(tiny, tmp_path):
    """A finished stage without run.steps: `resume` says so and names run.epochs; with run.epochs raised in its
    config.yaml it trains on from its last checkpoint to the steps the new epochs give, and exports again."""
    run_dir = run_stage(tiny, tmp_path, "sft", run={"steps": None, "epochs": 0.1})
    status = json.loads((run_dir / "status.json").read_text())
    batch = yaml.safe_load((run_dir / "config.yaml").read_text())["train"]["batch_size"]
    steps = status["steps"]  # (resume reads the stage's rows here, not from the data again)
    assert status["train_rows"] > 0 and steps == max(1, math.ceil(0.1 * status["train_rows"] / batch))
    first = weights(run_dir)
    again = cli("resume", run_dir, timeout=120)
    assert again.returncode == 0 and (f"the run finished all its {steps} steps, nothing to resume (to train longer, "
                                      f"raise run.epochs in {run_dir / 'config.yaml'}") in again.stdout, again.stdout
    text = (run_dir / "config.yaml").read_text()
    assert "\n  epochs: 0.1\n" in text
    (run_dir / "config.yaml").write_text(text.replace("\n  epochs: 0.1\n", "\n  epochs: 0.2\n"))
    more = cli("resume", run_dir)
    assert more.returncode == 0, more.stdout + more.stderr
    status = json.loads((run_dir / "status.json").read_text())
    assert status["state"] == "finished" and status["steps"] >= 2 * steps - 1
    assert [r["step"] for r in records(run_dir)] == list(range(status["steps"]))
    assert max((weights(run_dir)[k] - first[k]).abs().max().item() for k in first) > 1e-4  # (a new export)


def test_packing_computes_the_same_loss_without_padding(tiny, tmp_path):
    one = {"run": {"steps": 1}, "train": {"eval_every": 1}}
    plain = run_stage(tiny, tmp_path / "plain", "sft", **one)
    packed = run_stage(tiny, tmp_path / "packed", "sft", run={"steps": 1}, train={"eval_every": 1, "packing": True})
    a, b = records(plain)[0], records(packed)[0]
    assert abs(a["loss"] - b["loss"]) < 1e-4, (a["loss"], b["loss"])  # attention stays within each row
    assert a["tokens"] == b["tokens"] and b["padding_frac"] == 0 < a["padding_frac"]
    assert max_difference(plain, packed) < 1e-4


def test_two_trainer_ranks_train_like_one(tiny, sft_run, tmp_path):
    # (their OpenMP threads spin before they sleep, run.openmp_spin, unless the environment says how long)
    run_dir = run_stage(tiny, tmp_path, "sft", placement={"trainer": {"workers": 2}}, run={"openmp_spin": 1000})
    spin = os.environ.get("GOMP_SPINCOUNT", "1000")
    for rank in (0, 1):
        assert f", GOMP_SPINCOUNT={spin} (each spins" in (run_dir / "logs" / f"trainer-{rank}.log").read_text()
    assert max_difference(run_dir, sft_run) < 1e-4  # the same batches, the gradients averaged over the ranks
    assert abs(records(run_dir)[-1]["eval_loss"] - records(sft_run)[-1]["eval_loss"]) < 1e-4


def test_the_micro_batch_size_does_not_change_what_sft_trains(tiny, sft_run, tmp_path):
    """Rows of 2 instead of 8: the step's loss is the mean over all its response tokens either way (it was a
    mean of the micro-batches' means, so a short response weighed as much as a long one, and a memory
    setting changed the model)."""
    run_dir = run_stage(tiny, tmp_path, "sft", train={"micro_batch_size": 2})
    assert max_difference(run_dir, sft_run) < 1e-4
    assert abs(records(run_dir)[-1]["eval_loss"] - records(sft_run)[-1]["eval_loss"]) < 1e-4


def test_a_steps_lr_is_the_rate_it_trained_with(tiny, tmp_path):
    """A warm-up of 4 steps at lr 0.002: steps 1 and 2 train at 0.0005 and 0.001 (it recorded the rate after
    the step: 0.001 and 0.0015)."""
    run_dir = run_stage(tiny, tmp_path, "rm", run={"steps": 2}, train={"warmup_steps": 4, "eval_every": 100})
    assert [r["lr"] for r in records(run_dir)] == pytest.approx([0.0005, 0.001])


def test_reward_model_learns_the_hidden_preference(rm_run):
    from toolkit.modeling import ScoreModel

    rs = records(rm_run)
    evals = [r for r in rs if "eval_accuracy" in r]
    assert evals[-1]["eval_accuracy"] >= 0.9 and evals[-1]["eval_margin"] > evals[0]["eval_margin"]
    stats = json.loads((rm_run / "export" / "reward_stats.json").read_text())
    assert stats["samples"] > 100 and stats["std"] > 0 and stats["rows"] == "rl part"
    # a reward model, and the critic's starting point: its score head is kept
    exported = load_file(rm_run / "export" / "model.safetensors")
    critic = ScoreModel(str(rm_run / "export"), torch.float32)
    assert torch.equal(critic.model.score.weight, exported["score.weight"])


def test_reward_model_killed_and_resumed_equals_an_uninterrupted_run(tiny, rm_run, tmp_path):
    config = write_config(tmp_path, stage_config(tiny, "rm", run={"steps": 20}, train={"eval_every": 5},
                                                 checkpoint={"every_steps": 5}))
    run_dir = tmp_path / "run"
    # (in step 8: after seven whole steps and the checkpoint of step 5)
    run_and_kill(config, run_dir, hold="training@8", until=lambda: metric_lines(run_dir) >= 7)
    assert metric_lines(run_dir) == 7
    result = cli("resume", run_dir)
    assert result.returncode == 0, result.stdout + result.stderr
    assert max_difference(run_dir, rm_run) <= 1e-6
    assert [r.get("eval_accuracy") for r in records(run_dir)] == [r.get("eval_accuracy") for r in records(rm_run)]
    assert json.loads((run_dir / "export" / "reward_stats.json").read_text()) == \
        json.loads((rm_run / "export" / "reward_stats.json").read_text())


def test_stage_config_errors_are_named(tiny, tmp_path):
    bad = stage_config(tiny, "sft", train={"batch_size": 30})
    result = cli("sft", write_config(tmp_path, bad), "--run-dir", tmp_path / "run")
    assert result.returncode == 2 and "train.batch_size (30) is not a multiple of train.micro_batch_size 8" \
        in result.stderr
    wrong = cli("rm", write_config(tmp_path, stage_config(tiny, "sft"), "s.yaml"), "--run-dir", tmp_path / "r2")
    assert wrong.returncode == 2 and "this is a 'sft' config" in wrong.stderr and "slurm-rlhf sft" in wrong.stderr
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt": "a", "chosen": "b", "rejected": "c"}\n{"prompt": "d", "chosen": "e"}\n')
    missing = stage_config(tiny, "rm", data={"sources": [{"path": str(rows)}], "split": None, "eval_fraction": 0})
    result = cli("rm", write_config(tmp_path, missing, "m.yaml"), "--run-dir", tmp_path / "r3")
    assert result.returncode == 2 and f"{rows}:2: field 'rejected' (the other response) is missing" in result.stderr
    assert not (tmp_path / "r3").exists()  # nothing was started, nothing half-written


def test_sigusr1_checkpoints_stops_and_resume_finishes_the_same(tiny, sft_run, tmp_path):
    """What a Slurm time limit does (--signal=B:USR1), here: the driver asks for a checkpoint, the ranks
    stop at the next step boundary, and `resume` ends with the uninterrupted run's weights."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from tests.conftest import REPO

    from toolkit.hold import ENV, held_file

    config = write_config(tmp_path, stage_config(tiny, "sft", checkpoint={"every_steps": 100}))
    run_dir = tmp_path / "run"
    # Rank 0 waits before its 4th step until the driver has taken the signal: then the stop cannot lose
    # a race with the run's end, however busy the machine.
    proc = subprocess.Popen([sys.executable, "-m", "toolkit", "sft", str(config), "--run-dir", str(run_dir)],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, ENV: "boundary@4"})
    with killed_at_exit(proc):
        deadline = time.monotonic() + 240
        held = held_file(run_dir, "boundary")
        while not held.exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGUSR1)
        out = ""
        while "stopping at the ranks' next step boundary" not in out:  # (printed once the driver has sent its request)
            line = proc.stdout.readline()
            assert line, proc.communicate()
            out += line
        held.unlink()  # (rank 0 goes on, and finds the driver's request at its next step boundary)
        rest, err = proc.communicate(timeout=120)
        out += rest
    assert proc.returncode == 0, out + err
    assert "stopping at the ranks' next step boundary" in out and "continue with: slurm-rlhf resume" in out
    stopped = metric_lines(run_dir)
    assert 3 <= stopped < 12 and json.loads((run_dir / "status.json").read_text())["state"] == "preempted"
    manifest = [json.loads(line) for line in (run_dir / "manifest.jsonl").read_text().splitlines()]
    assert [r["step"] for r in manifest if r["kind"] == "checkpoint"] == [stopped]  # the stop's own checkpoint
    result = cli("resume", run_dir)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"resuming after step {stopped}: checkpoint checkpoints/step-{stopped:06d} (step {stopped})" in result.stdout
    assert max_difference(run_dir, sft_run) <= 1e-6


def test_a_pipeline_resumed_keeps_the_overrides_it_was_started_with(tiny, tmp_path):
    """`run PIPELINE --set ...` stopped during its first stage, then `resume PIPELINE_DIR`: the stages that
    had not started run with the overrides too (before, with the file's values: here another split seed,
    so RL's prompts were rows that SFT and the reward model had trained on, and 30 steps instead of 2). A
    resume names the settings a started stage keeps against the pipeline's, and refuses to go on from stages
    that started from an export written again since."""
    import signal

    from tests.conftest import REPO, start_held

    pipeline = Path(REPO) / "templates" / "examples" / "tiny-pipeline.yaml"
    overrides = ["sft.run.epochs=1", "rm.run.epochs=1", "rl.run.steps=2", "data.split.seed=99"]
    run_dir = tmp_path / "p"
    command = [str(pipeline), *[a for o in overrides for a in ("--set", o)]]
    proc, _ = start_held(pipeline, run_dir, "training@3", extra=command[1:], held_in=run_dir / "sft")
    with killed_at_exit(proc):
        os.kill(proc.pid, signal.SIGTERM)
        output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 143 and not (run_dir / "rl").exists()
    # (it said only `interrupted (SIGTERM): every worker was stopped`: not which stage, nor how to go on)
    assert f"interrupted (SIGTERM): every worker was stopped (pipeline stage sft, {run_dir / 'sft'}); continue " \
           f"the pipeline with: slurm-rlhf resume {run_dir}" in output, output
    result = cli("resume", run_dir)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "with the --set overrides it was started with: " + " ".join(overrides) in result.stdout
    for stage in ("sft", "rm", "rl"):
        config = yaml.safe_load((run_dir / stage / "config.yaml").read_text())
        assert config["data"]["split"]["seed"] == 99, stage
    assert len(records(run_dir / "rl")) == 2
    assert "keeps the settings it started with" not in result.stdout  # (the same settings)
    # A setting changed in the pipeline (here in the overrides it keeps) is named for each stage that keeps its own.
    made = json.loads((run_dir / "pipeline.json").read_text())
    (run_dir / "pipeline.json").write_text(json.dumps({**made, "overrides": [*overrides, "rl.trainer.lr=0.0005"]}))
    result = cli("resume", run_dir)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"stage rl keeps the settings it started with ({run_dir / 'rl' / 'config.yaml'}); the pipeline file now " \
           "says otherwise for trainer.lr" in result.stdout, result.stdout
    # SFT trained on and exported again: the reward model and RL started from the export before, so the pipeline
    # does not go on as if they were of this one.
    config = yaml.safe_load((run_dir / "sft" / "config.yaml").read_text())
    config["run"]["epochs"] = 2
    (run_dir / "sft" / "config.yaml").write_text(yaml.safe_dump(config))
    assert cli("resume", run_dir / "sft").returncode == 0
    result = cli("resume", run_dir)
    assert result.returncode == 2 and f"stage rm started from {run_dir / 'sft' / 'export'} before stage sft exported " \
        "again" in result.stderr, result.stdout + result.stderr
