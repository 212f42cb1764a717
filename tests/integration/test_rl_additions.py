"""RL beside GRPO and PPO: RLOO and REINFORCE++ (their advantages recomputed by hand from the committed
HDF5 records), an EMA of the actor (equal to the average of the checkpointed weights), the PTX mixture,
reward normalisation and clipping, and a PPO critic started from a reward model."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from safetensors.torch import load_file

from tests.conftest import EXAMPLES, assert_clean_logs, cli, example, write_config
from toolkit.store import experience

pytestmark = pytest.mark.integration


def run(tiny, tmp_path: Path, name: str, **sections) -> tuple[Path, list[dict]]:
    """A short run of the example with `sections` merged in. It generates with the transformers engine
    unless `rollout.backend` says otherwise: what these tests check is the trainer's and the scorer's, and
    a run starts about 6 s sooner without vLLM."""
    sections["run"] = {"steps": 3, "name": name, "seed": 4, **sections.get("run", {})}
    sections["rollout"] = {"backend": "hf", **sections.get("rollout", {})}
    config = write_config(tmp_path / f"{name}-config", example("tiny-grpo.yaml", tiny, **sections))
    run_dir = tmp_path / name
    result = cli("run", config, "--run-dir", run_dir)
    assert result.returncode == 0, result.stdout + result.stderr
    assert_clean_logs(run_dir)
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for m in metrics:
        assert m["behaviour_logprob_diff"] < 1e-4 and np.isfinite(m["loss"])
    return run_dir, metrics


def per_sample(record: dict, name: str) -> list[np.ndarray]:
    """A per-response-token array of a record, cut into its samples."""
    offsets = record["samples"]["response_offsets"]
    values = record["experience"][name] if name in record["experience"] else record["samples"][name]
    return [values[offsets[i]: offsets[i + 1]] for i in range(len(offsets) - 1)]


@pytest.fixture(scope="module")
def rloo_run(tiny, tmp_path_factory) -> tuple[Path, list[dict]]:
    """RLOO, 3 steps of 2 optimizer steps each, with a cosine learning-rate schedule after one step of
    warm-up."""
    return run(tiny, tmp_path_factory.mktemp("rloo"), "rloo", run={"algorithm": "rloo"},
               algorithm={"kl": {"coef": 0.05}},
               trainer={"updates_per_step": 2, "lr_schedule": "cosine", "warmup_steps": 1, "min_lr_ratio": 0.1})


def test_rloo_advantages_are_leave_one_out(rloo_run):
    run_dir, _ = rloo_run
    rec = experience.read(run_dir / "experience" / experience.file_name(2))
    kl = np.array([(o - r).sum() for o, r in zip(per_sample(rec, "old_logprobs"), per_sample(rec, "ref_logprobs"))])
    reward = rec["samples"]["reward_total"] - 0.05 * kl  # the KL-penalised sequence reward, as the paper
    groups = rec["samples"]["group_index"]
    for i, adv in enumerate(per_sample(rec, "advantages")):
        others = reward[(groups == groups[i]) & (np.arange(len(groups)) != i)]
        assert np.allclose(adv, reward[i] - others.mean(), atol=1e-5)  # the same for every token


def test_a_cosine_schedule_spans_the_rl_runs_optimizer_steps(rloo_run):
    """The schedule spans the run's optimizer steps (run.steps x epochs x updates_per_step: 6 here); the
    RL trainer once built its engines without that length, and a cosine schedule stayed at lr. A step's `lr`
    is the rate of its first update (it was the rate after its last: one step ahead, the warm-up's not shown)."""
    _, metrics = rloo_run
    lr = yaml.safe_load((EXAMPLES / "tiny-grpo.yaml").read_text())["trainer"]["lr"]
    for step, m in enumerate(metrics):
        done = 2 * step  # optimizer steps before this step's first update; the first was the warm-up's
        expected = lr * (1.0 if done < 1 else 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (done - 1) / 5)))
        assert m["lr"] == pytest.approx(expected, rel=1e-5), (step, m["lr"], expected)
    assert metrics[0]["lr"] == pytest.approx(lr) and metrics[-1]["lr"] < metrics[1]["lr"] < lr


def test_reinforce_pp_advantages_are_batch_normalised_returns(tiny, tmp_path):
    run_dir, _ = run(tiny, tmp_path, "rpp", run={"algorithm": "reinforce_pp"}, algorithm={"kl": {"coef": 0.05}})
    rec = experience.read(run_dir / "experience" / experience.file_name(2))
    returns = []
    for score, old, ref in zip(rec["samples"]["reward_total"], per_sample(rec, "old_logprobs"),
                               per_sample(rec, "ref_logprobs")):
        r = -0.05 * (old - ref)
        r[-1] += score
        returns.append(np.cumsum(r[::-1])[::-1])  # gamma 1: the sum of the rewards from each token on
    flat = np.concatenate(returns)
    expected = (flat - flat.mean()) / np.sqrt(flat.var() + 1e-8)
    assert np.allclose(np.concatenate(per_sample(rec, "advantages")), expected, atol=1e-4)


EMA_DECAY = 0.5


@pytest.fixture(scope="module")
def ema_run(tiny, tmp_path_factory) -> tuple[Path, list[dict]]:
    """A default GRPO run of 4 steps with trainer.ema (an average kept beside the weights, which it leaves
    as they are) and a checkpoint at every step: the EMA test reads its checkpoints, and the test of the
    skipped old log-prob pass takes it as its run without the pass."""
    return run(tiny, tmp_path_factory.mktemp("ema"), "ema", run={"steps": 4}, trainer={"ema": EMA_DECAY},
               checkpoint={"every_steps": 1, "keep": 10})


def test_ema_is_the_average_of_the_weights_and_is_exported(tiny, ema_run):
    decay = EMA_DECAY
    run_dir, _ = ema_run
    names = list(load_file(tiny / "model" / "model.safetensors"))
    average = load_file(tiny / "model" / "model.safetensors")  # it starts from the initial weights
    for step in range(1, 5):
        w = load_file(run_dir / "checkpoints" / f"step-{step:06d}" / "hf" / "model.safetensors")
        average = {k: decay * average[k] + (1 - decay) * w[k] for k in names}
    exported = load_file(run_dir / "export-ema" / "model.safetensors")
    assert max((exported[k] - average[k]).abs().max().item() for k in names) < 1e-5
    final = load_file(run_dir / "export" / "model.safetensors")
    assert max((exported[k] - final[k]).abs().max().item() for k in names) > 1e-4  # not the last weights


def test_ema_turned_on_at_a_resume_starts_from_the_resumed_weights(rloo_run, tmp_path):
    """trainer.ema set in RUN_DIR/config.yaml of a run that had none, and run.steps raised: its checkpoint has
    no ema.safetensors, and the resume ended in a FileNotFoundError (a traceback from the trainer). The
    average starts from the checkpoint's weights instead, and the driver says so."""
    run_dir = tmp_path / "run"
    shutil.copytree(rloo_run[0], run_dir)
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    config["run"]["steps"], config["trainer"]["ema"] = 4, EMA_DECAY
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    result = cli("resume", run_dir)
    assert result.returncode == 0, result.stdout + result.stderr
    assert ("trainer.ema: checkpoints/step-000003 has no EMA (trainer.ema was off when it was saved): the average "
            "starts from its weights") in result.stdout
    start, last = (load_file(run_dir / "checkpoints" / f"step-{s:06d}" / "hf" / "model.safetensors") for s in (3, 4))
    exported = load_file(run_dir / "export-ema" / "model.safetensors")
    assert max((exported[k] - (EMA_DECAY * start[k] + (1 - EMA_DECAY) * last[k])).abs().max().item()
               for k in start) < 1e-5


def test_ptx_mixes_a_language_modelling_loss_in(tiny, tmp_path):
    text = {"sources": [{"path": str(tiny / "pipeline.jsonl")}], "text_key": "response"}
    run_dir, metrics = run(tiny, tmp_path, "ptx", run={"steps": 6}, ptx={"coef": 1.0, "data": text, "max_tokens": 32})
    losses = [m["ptx_loss"] for m in metrics]
    assert losses[-1] < losses[0] - 0.1, losses  # the text is learned too
    assert all(abs(m["loss"] - m["pg_loss"] - 0.01 * m["kl_loss"] - m["ptx_loss"]) < 1e-3 for m in metrics)


def test_reward_normalised_clipped_and_a_critic_from_the_reward_model(tiny, tmp_path):
    rm = tmp_path / "rm"
    shutil.copytree(tiny / "reward_model", rm)
    (rm / "reward_stats.json").write_text(json.dumps({"mean": 0.2, "std": 0.5}))
    run_dir, metrics = run(tiny, tmp_path, "norm", run={"algorithm": "ppo"},
                           model={"actor": str(tiny / "model"), "critic": str(rm)},
                           reward={"functions": [], "clip": 0.3, "models": [{"path": str(rm), "normalize": True,
                                                                              "name": "rm"}]})
    rec = experience.read(run_dir / "experience" / experience.file_name(0))
    from toolkit.modeling import ScoreModel, last_token_scores

    model = ScoreModel(str(rm), torch.float32).eval()
    batch = experience.batch_of(rec)
    raw = last_token_scores(model, [batch.prompt(i).tolist() + batch.response(i).tolist() for i in range(8)], 0, 8,
                            torch.device("cpu")).numpy()
    assert np.allclose(rec["samples"]["rewards"][:8, 0], (raw - 0.2) / 0.5, atol=1e-4)  # normalised
    assert np.allclose(rec["samples"]["reward_total"], np.clip(rec["samples"]["rewards"][:, 0], -0.3, 0.3))
    assert abs(rec["samples"]["reward_total"]).max() <= 0.3 + 1e-6 and "value_loss" in metrics[0]


def test_grpo_with_one_update_takes_old_logprobs_from_the_training_forward(tiny, tmp_path, ema_run):
    """The separate old log-prob pass is skipped (GRPO, one update per batch): the same update as with it.
    The comparison run keeps the pass by turning the behaviour correction on, whose weights are 1 here
    (on-policy samples) up to the generator's rounding. (The run without the pass is `ema_run`: the EMA
    and the checkpoints change nothing in the updates.)"""
    skip_dir, skipped = ema_run
    full_dir, full = run(tiny, tmp_path, "full", run={"steps": 4}, algorithm={"behaviour_correction": "on"})
    assert len(skipped) == len(full) == 4
    for a, b in zip(skipped, full):
        assert abs(a["loss"] - b["loss"]) < 1e-4 and abs(a["kl"] - b["kl"]) < 1e-5
        assert a["reward_mean"] == b["reward_mean"] or a["step"] > 0
        assert abs(b["behaviour_weight"] - 1) < 1e-4
    weights = load_file(skip_dir / "export" / "model.safetensors")
    reference = load_file(full_dir / "export" / "model.safetensors")
    assert max((weights[k] - reference[k]).abs().max().item() for k in weights) < 1e-4
    assert "old_logprobs" not in experience.read(skip_dir / "experience" / experience.file_name(1))["experience"]
    assert "old_logprobs" in experience.read(full_dir / "experience" / experience.file_name(1))["experience"]


@pytest.mark.parametrize("backend", ["vllm", "hf"])
def test_ignore_eos_runs_every_response_to_full_length(tiny, tmp_path, backend):
    run_dir, metrics = run(tiny, tmp_path, f"full-{backend}", run={"steps": 2},
                           rollout={"ignore_eos": True, "backend": backend, "max_new_tokens": 64})
    for m in metrics:
        assert m["response_len_mean"] == 64 and m["finished_frac"] == 0
    # (run() asserted behaviour_logprob_diff < 1e-4 at each step: either engine samples with the trainer's weights)
    assert f"starting the {backend} engine" in (run_dir / "logs" / "generator-0.log").read_text()
    eos = json.loads((tiny / "model" / "config.json").read_text())["eos_token_id"]
    past_eos = 0
    for step in range(2):  # some samples drew the end-of-sequence token and went on
        responses = per_sample(experience.read(run_dir / "experience" / experience.file_name(step)), "response_tokens")
        past_eos += sum(bool((r[:-1] == eos).any()) for r in responses)
    assert past_eos > 0


def test_token_budget_micro_batches_make_the_update_of_the_token_mean(tiny, tmp_path):
    """trainer.micro_batch_tokens: each of two trainer ranks takes its half of the update in one
    micro-batch, or in many small ones of a few rows (as many on both ranks, which cut their samples
    differently), padded or packed into one sequence each (model.packing, which also packs the reference
    model's scoring), or one rank takes the whole update, and it is the same update (the loss is the token
    mean of the update's samples however they are cut and shared out: before, of each rank's, so one rank
    and two differed); rows of micro_batch_size (a mean of each micro-batch's token mean) make another. By
    token budget, micro_batch_size (here 48 of 64 samples) need not divide a step's samples."""
    two = {"trainer": {"workers": 2}}
    one_dir, one = run(tiny, tmp_path, "one", run={"steps": 1}, trainer={"micro_batch_tokens": 10**6}, placement=two)
    alone_dir, _ = run(tiny, tmp_path, "alone", run={"steps": 1},  # (64 samples: micro_batch_size need not divide them)
                       trainer={"micro_batch_tokens": 10**6, "micro_batch_size": 48})
    many_dir, many = run(tiny, tmp_path, "many", run={"steps": 1}, trainer={"micro_batch_tokens": 280}, placement=two)
    packed_dir, packed = run(tiny, tmp_path, "packed", run={"steps": 1}, trainer={"micro_batch_tokens": 280},
                             model={"actor": str(tiny / "model"), "packing": True}, placement=two)
    rows_dir, rows = run(tiny, tmp_path, "rows", run={"steps": 1}, trainer={"micro_batch_size": 4}, placement=two)
    assert one[0]["micro_batches"] == 1 and many[0]["micro_batches"] >= 4 and rows[0]["micro_batches"] == 8
    assert many[0]["padding_frac"] < one[0]["padding_frac"] and packed[0]["padding_frac"] == 0
    assert 2 <= packed[0]["micro_batches"] <= many[0]["micro_batches"]  # (280 tokens of samples, not of rows)
    assert one[0]["reward_mean"] == many[0]["reward_mean"] == packed[0]["reward_mean"] == rows[0]["reward_mean"]
    weights, cut, by_rows, in_one, on_one_rank = (load_file(d / "export" / "model.safetensors")
                                                  for d in (one_dir, many_dir, rows_dir, packed_dir, alone_dir))
    assert max((weights[k] - cut[k]).abs().max().item() for k in weights) < 1e-4  # (lr 1e-3)
    assert max((weights[k] - on_one_rank[k]).abs().max().item() for k in weights) < 1e-4
    assert max((weights[k] - in_one[k]).abs().max().item() for k in weights) < 1e-4
    assert max((weights[k] - by_rows[k]).abs().max().item() for k in weights) > 1e-3
    assert abs(packed[0]["kl"] - one[0]["kl"]) < 1e-5  # the scorer's packed reference log-probs


def test_packed_ppo_scores_and_trains_as_padded(tiny, tmp_path):
    """model.packing in PPO: the actor's old log-probs, the reference's log-probs and the critic's values
    (committed in the HDF5 record) and both models' training equal the padded run's."""
    sections = dict(run={"steps": 2, "algorithm": "ppo"}, algorithm={"kl": {"coef": 0.05}},
                    trainer={"micro_batch_size": 4})
    padded_dir, padded = run(tiny, tmp_path, "padded", **sections)
    packed_dir, packed = run(tiny, tmp_path, "packed", model={"actor": str(tiny / "model"), "packing": True},
                             **sections)
    assert packed[-1]["padding_frac"] == 0 < padded[-1]["padding_frac"]
    for a, b in zip(padded, packed):
        assert abs(a["value_loss"] - b["value_loss"]) < 1e-5 and abs(a["pg_loss"] - b["pg_loss"]) < 1e-5
    records = [experience.read(d / "experience" / experience.file_name(1)) for d in (padded_dir, packed_dir)]
    assert np.array_equal(records[0]["samples"]["response_tokens"], records[1]["samples"]["response_tokens"])
    for name in ("old_logprobs", "ref_logprobs", "values"):
        a, b = (r["experience"][name] if name in r["experience"] else r["samples"][name] for r in records)
        assert np.abs(a - b).max() < 1e-5, name
    weights, packed_weights = (load_file(d / "export" / "model.safetensors") for d in (padded_dir, packed_dir))
    assert max((weights[k] - packed_weights[k]).abs().max().item() for k in weights) < 1e-4
