"""Whole runs on tiny random models of the architecture families users bring, tied and untied, dense and
mixture-of-experts: after every weight sync vLLM samples with exactly the trainer's weights.

Each run has two workers, a vLLM generator and a trainer that also holds the reference and the reward
(`colocate_all_models`): the sync under test is the broadcast between them, and a scorer of its own
would only add a process's start-up (about 6 s a family).

`behaviour_logprob_diff` (generator vs trainer log-probs of every sampled token) and `sync_check_diff`
(the probe check after each sync) stay below 1e-4 at every step. Before the repair in
`toolkit/weights/vllm_extension.py`, the tied families drifted to 0.05-0.1 within 6 steps at this
learning rate and the mixture of experts was wrong from the first sync.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import REPO, cli, example, write_config
from toolkit.tiny import build_family

pytestmark = pytest.mark.integration
FAMILIES = ["mistral", "qwen2", "qwen2-tied", "qwen3-tied", "gemma-tied", "gpt2-tied", "opt-tied", "gpt-neox",
            "qwen2-moe"]


def run_exactly(family: str, tiny, tmp_path, **sections) -> Path:
    """A 3-step GRPO run of the tiny `family` model at lr 1e-3 (`sections`: the placement and the rest); check
    that the generators sampled with exactly the trainer's weights at every step; its run directory."""
    model_dir = build_family(REPO / "models" / f"tiny-{family}", family)
    config = write_config(tmp_path, example("tiny-grpo.yaml", tiny, run={"steps": 3, "name": family, "seed": 1},
                                            model={"actor": str(model_dir)},
                                            rollout={"prompts_per_step": 8, "group_size": 4, "max_new_tokens": 16},
                                            **sections))
    run_dir = tmp_path / "run"
    result = cli("run", config, "--run-dir", run_dir)
    assert result.returncode == 0, result.stdout + result.stderr
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2]
    for r in records:
        assert r["behaviour_logprob_diff"] <= 1e-4, (family, r["step"], r["behaviour_logprob_diff"])
        assert r["sync_check_diff"] <= 1e-4, (family, r["step"], r["sync_check_diff"])
    assert records[-1]["kl_loss"] > 1e-4  # the policy moved away from the reference (lr 1e-3): a stale copy would show
    return run_dir


@pytest.mark.parametrize("family", FAMILIES)
def test_weight_sync_exact_for_every_family(family, tiny, tmp_path):
    run_dir = run_exactly(family, tiny, tmp_path, placement={"strategy": "colocate_all_models"})
    log = (run_dir / "logs" / "generator-0.log").read_text()
    assert "not loaded" not in log  # every weight reached vLLM


@pytest.mark.parametrize("family", ["gpt2-tied", "qwen2-moe"])
def test_weights_loaded_into_vllm_in_the_trainers_ranks_are_exact(family, tiny, tmp_path):
    """The same check where vLLM runs in each trainer rank's process (Flattening over 2 ranks under ZeRO-3,
    `rollout.backend: auto`): the weights go in memory, gathered from both ranks' shards and converted to the
    checkpoint's layout (GPT-2's transposed Conv1D weights and tied head; the experts of a mixture), not by
    broadcast."""
    run_dir = run_exactly(family, tiny, tmp_path, trainer={"zero_stage": 3},
                          placement={"strategy": "flattening", "all": {"workers": 2}})
    for rank in (0, 1):
        log = (run_dir / "logs" / f"all-{rank}.log").read_text()
        assert "generating with vLLM in the trainer's process" in log and "not loaded" not in log, rank
