"""The memory switches with real DeepSpeed engines and real runs: activation checkpointing, ZeRO-Offload
(DeepSpeed's CPU Adam; parameters too under ZeRO-3), LoRA (peft) and the attention implementation. Each
shows its effect with a measured figure (tools/bench_memory.py), and the training result stays what it
should be. A LoRA policy trains through a whole GRPO run: its reference is the actor with the adapters
disabled, vLLM gets the merged weights, and the export is a plain model with the adapters beside it."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from tests.conftest import REPO, assert_clean_logs, cli, example, metric_lines, run_and_kill, write_config
from tests.integration.test_stages import max_difference, records, run_stage, stage_config
from toolkit.store import experience

pytestmark = pytest.mark.integration

SHAPE = {"hidden": 64, "layers": 2, "heads": 4, "intermediate": 128}
RANK = 8


@pytest.fixture(scope="module")
def figures(tmp_path_factory) -> dict[str, dict]:
    out = tmp_path_factory.mktemp("bench") / "figures.json"
    shape = [f"--{k}={v}" for k, v in SHAPE.items()]
    # (two settings at a time, a thread each: nothing here compares their step times)
    done = subprocess.run([sys.executable, "tools/bench_memory.py", *shape, "--batch=4", "--seq=64", "--steps=3",
                           "--jobs=2", "--threads=1", f"--json={out}"], cwd=REPO, capture_output=True, text=True,
                          timeout=1200)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "max loss diff" in done.stdout  # the table
    return {r["setting"]: r for r in json.loads(out.read_text())}


def lora_parameters(hidden: int, intermediate: int, layers: int, rank: int, kv: int | None = None) -> int:
    """Adapter parameters on every linear layer of a Llama but its output head: r x (in + out) each."""
    kv = kv or hidden
    per_layer = 2 * (hidden + hidden) + 2 * (hidden + kv) + 2 * (hidden + intermediate) + (intermediate + hidden)
    return layers * rank * per_layer


def loss_diff(a: dict, b: dict) -> float:
    return max(abs(x - y) for x, y in zip(a["losses"], b["losses"]))


def test_activation_checkpointing_keeps_less_and_computes_the_same(figures):
    base, ckpt = figures["baseline"], figures["checkpointing"]
    assert ckpt["saved_activation_bytes"] < 0.5 * base["saved_activation_bytes"]  # measured: 0.39
    assert loss_diff(ckpt, base) < 1e-5
    lora, both = figures["lora"], figures["lora+checkpointing"]
    assert both["saved_activation_bytes"] < 0.5 * lora["saved_activation_bytes"]
    assert loss_diff(both, lora) < 1e-5


def test_zero_offload_updates_with_cpu_adam_and_trains_the_same(figures):
    base = figures["baseline"]
    assert base["optimizer"].endswith("/AdamW")
    assert figures["offload_optimizer"]["optimizer"].endswith("/DeepSpeedCPUAdam")
    assert loss_diff(figures["offload_optimizer"], base) < 1e-5
    zero3 = figures["zero3_offload"]
    assert zero3["optimizer"] == "DeepSpeedZeroOptimizer_Stage3/DeepSpeedCPUAdam"
    assert loss_diff(zero3, base) < 1e-4


def test_lora_trains_the_adapters_only(figures):
    base, lora = figures["baseline"], figures["lora"]
    expected = lora_parameters(SHAPE["hidden"], SHAPE["intermediate"], SHAPE["layers"], RANK)
    assert lora["trainable"] == expected and lora["total"] == base["total"] + expected
    assert lora["trainable"] < 0.15 * base["trainable"]
    # Adam keeps two fp32 tensors per trained parameter, nothing for the frozen ones
    assert base["optimizer_state_bytes"] == 8 * base["trainable"]
    assert lora["optimizer_state_bytes"] == 8 * lora["trainable"]
    assert abs(lora["losses"][0] - base["losses"][0]) < 1e-6  # B starts at 0: the base model's loss
    assert abs(lora["losses"][1] - base["losses"][1]) > 1e-6  # then it trains other weights


def test_zeros_gradient_bucket_is_no_larger_than_the_trained_parameters(figures):
    # DeepSpeed's default bucket (500M elements, 2 GB in fp32) is allocated for every backward pass; a
    # bucket of the trained parameters' size left the Separation trainer of tools/bench_trl.py at 2.1 GB
    # resident instead of 4.0 GB (README: Speed against TRL)
    for name in ("baseline", "lora", "offload_optimizer", "zero3_offload"):
        assert figures[name]["reduce_bucket"] == figures[name]["trainable"], name


def test_eager_and_sdpa_attention_train_the_same(figures):
    assert loss_diff(figures["eager_attention"], figures["baseline"]) < 1e-4


def test_a_lora_policy_trains_with_vllm_and_exports_merged(tiny, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    config = write_config(tmp_path, example("tiny-grpo.yaml", tiny, run={"steps": 3, "name": "lora", "seed": 4},
                                            trainer={"lr": 0.01, "lora": {"rank": RANK},
                                                     "gradient_checkpointing": True}))
    run_dir = tmp_path / "run"
    result = cli("run", config, "--run-dir", run_dir)
    assert result.returncode == 0, result.stdout + result.stderr
    assert_clean_logs(run_dir)  # (vLLM's expected "RotaryEmbedding: Failed to load weights" filtered out)
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [0, 1, 2]
    for m in metrics:  # vLLM holds the merged weights after every sync
        assert m["behaviour_logprob_diff"] < 1e-4 and m["sync_check_diff"] < 1e-4
    assert abs(metrics[0]["kl"]) < 1e-6 and metrics[2]["kl"] > 1e-4  # the reference: the actor without adapters
    first = experience.read(run_dir / "experience" / experience.file_name(0))
    assert torch.allclose(torch.from_numpy(first["samples"]["ref_logprobs"]),
                          torch.from_numpy(first["samples"]["behaviour_logprobs"]), atol=1e-5)
    later = experience.read(run_dir / "experience" / experience.file_name(2))
    assert (later["samples"]["ref_logprobs"] - later["samples"]["behaviour_logprobs"]).max() > 1e-4

    log = (run_dir / "logs" / "trainer-0.log").read_text()
    trained, total = (int(x.replace(",", "")) for x in re.search(r"([\d,]+) of ([\d,]+) parameters trained", log)
                      .groups())
    cfg = json.loads((tiny / "model" / "config.json").read_text())
    kv = cfg["hidden_size"] // cfg["num_attention_heads"] * cfg["num_key_value_heads"]
    assert trained == lora_parameters(cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"], RANK, kv)
    assert "roles: reward\n" in (run_dir / "logs" / "scorer-0.log").read_text()  # no reference model of its own

    base = load_file(tiny / "model" / "model.safetensors")
    merged = load_file(run_dir / "export" / "model.safetensors")
    assert set(merged) == set(base)  # a plain model: the base model's names, no adapter tensors
    adapted = [k for k in base if k.endswith("proj.weight")]
    frozen = [k for k in base if k not in adapted]
    assert adapted and all(torch.equal(merged[k], base[k]) for k in frozen)
    assert all((merged[k] - base[k]).abs().max() > 0 for k in adapted)
    ids = torch.tensor([[1, 40, 41, 42, 43, 44, 45, 46]])
    plain = AutoModelForCausalLM.from_pretrained(run_dir / "export")
    with_adapters = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny / "model"),
                                              run_dir / "export" / "adapter")
    assert (plain(input_ids=ids).logits - with_adapters(input_ids=ids).logits).abs().max() < 1e-4
    # `slurm-rlhf export` gives the same merged model, and says so
    result = cli("export", run_dir, tmp_path / "exported")
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "exported" / "model.safetensors").read_bytes() == (run_dir / "export" / "model.safetensors").read_bytes()
    assert (tmp_path / "exported" / "adapter").is_dir()
    assert json.loads((tmp_path / "exported" / "slurm_rlhf.json").read_text())["lora_merged"] is True


@pytest.fixture(scope="module")
def lora_sft(tiny, tmp_path_factory) -> Path:
    return run_stage(tiny, tmp_path_factory.mktemp("lora-sft"), "sft", train={"lora": {"rank": RANK}, "lr": 0.01})


def test_lora_sft_learns(tiny, lora_sft):
    losses = [r["loss"] for r in records(lora_sft)]
    assert sum(losses[-4:]) / 4 < losses[0] - 0.15, losses  # (measured: 6.28 -> 5.99)
    log = (lora_sft / "logs" / "trainer-0.log").read_text()
    cfg = json.loads((tiny / "model" / "config.json").read_text())
    kv = cfg["hidden_size"] // cfg["num_attention_heads"] * cfg["num_key_value_heads"]
    expected = lora_parameters(cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"], RANK, kv)
    assert f"PeftModelForCausalLM: ZeRO-2, {expected:,} of " in log and "LoRA rank 8" in log
    assert (lora_sft / "export" / "adapter" / "adapter_config.json").is_file()


def test_lora_sft_killed_and_resumed_equals_an_uninterrupted_run(tiny, lora_sft, tmp_path):
    config = write_config(tmp_path, stage_config(tiny, "sft", train={"lora": {"rank": RANK}, "lr": 0.01}))
    run_dir = tmp_path / "run"
    # (in step 7, after six whole steps, whatever the load)
    run_and_kill(config, run_dir, hold="training@7", until=lambda: metric_lines(run_dir) >= 6)
    assert metric_lines(run_dir) == 6
    result = cli("resume", run_dir)
    assert result.returncode == 0, result.stdout + result.stderr
    assert max_difference(run_dir, lora_sft) <= 1e-6
    assert [r["loss"] for r in records(run_dir)] == [r["loss"] for r in records(lora_sft)]


@pytest.mark.parametrize("section, values, expected", [
    ("train", {"lora": None}, "train.lora is no lora, but the checkpoint"),
    ("train", {"zero_stage": 0}, "train.zero_stage is 0, but the checkpoint"),
    ("placement", {"trainer": {"workers": 2}}, "placement.trainer.workers is 2, but the checkpoint"),
])
def test_a_resume_under_other_adapters_zero_stage_or_ranks_is_refused_before_a_worker_starts(lora_sft, tmp_path,
                                                                                             section, values, expected):
    """The run's config edited before a resume (to train longer) with the LoRA adapters removed, ZeRO-2 made
    ZeRO-0, or two trainer workers for one: DeepSpeed cannot load the checkpoint into such engines, and every
    trainer failed with its traceback (`Missing key(s) in state_dict`, an AttributeError, `ZeRORuntimeException`).
    The driver names the field before any worker starts."""
    run_dir = tmp_path / "run"
    shutil.copytree(lora_sft, run_dir)
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    config["run"]["steps"] += 4
    config[section].update(values)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    log = run_dir / "logs" / "trainer-0.log"
    before = log.stat().st_size
    result = cli("resume", run_dir, timeout=120)
    assert result.returncode == 2, result.stdout + result.stderr
    assert expected in result.stderr and f"set {expected.split(' is ')[0]} back to" in result.stderr, result.stderr
    assert log.stat().st_size == before  # (no trainer started)
