"""The reward role on real (tiny) models, without processes: a reward model reads the end of the response
(a long prompt is cut from the left), components are weighted and the total clipped."""

from __future__ import annotations

import shutil
from types import SimpleNamespace

import numpy as np
import torch

from tests.conftest import example, write_config
from tests.unit.test_samples_and_modeling import batch as make_batch
from toolkit.config import load_config
from toolkit.roles.scorer import RewardRole
from toolkit.tiny import build_tokenizer


def reward_role(cfg) -> RewardRole:
    group = SimpleNamespace(gpus_per_worker=0, roles=("reward",), models=("reward",), workers=1)
    worker = SimpleNamespace(cfg=cfg, status={}, group=group)
    role = RewardRole(worker)
    role.setup()
    return role


def test_a_long_prompt_loses_its_start_not_the_response(tiny, tmp_path):
    rm = tmp_path / "rm"
    shutil.copytree(tiny / "reward_model", rm)
    build_tokenizer(rm, seed=7)  # another vocabulary: the scorer tokenizes the texts itself
    cfg = load_config(write_config(tmp_path, example(
        "tiny-grpo.yaml", tiny, rollout={"max_prompt_tokens": 8, "max_new_tokens": 8},
        reward={"functions": [{"function": "toolkit.rewards.examples:digit_ratio"}], "clip": 0.75,
                "models": [{"path": str(rm), "weight": 0.5, "name": "rm"}]})))
    role = reward_role(cfg)
    assert not role.reward_models[0].same_vocab
    b = make_batch()
    long_prompt = " ".join(["apples and rivers"] * 30)
    b.prompts, b.responses = [long_prompt, "short"], ["the end 42", "9 9 9"]
    role.score(b)
    model, tokenizer = role.reward_models[0].model, role.reward_models[0].tokenizer
    response = tokenizer("the end 42", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    prompt = tokenizer(long_prompt)["input_ids"]
    kept = prompt[len(prompt) - (16 - len(response)):] + response  # 16 = max_prompt_tokens + max_new_tokens
    with torch.no_grad():
        expected = model(torch.tensor([kept]))[0, -1].item()
        right_cut = model(torch.tensor([(prompt + response)[:16]]))[0, -1].item()  # the old behaviour
    assert abs(b.rewards[0, 1] - expected) < 1e-5
    assert abs(expected - right_cut) > 1e-3  # (so the test tells the two apart)
    # the total: 1.0 x digit_ratio + 0.5 x rm, clipped to [-0.75, 0.75]
    total = b.rewards @ np.array([1.0, 0.5], np.float32)
    assert np.allclose(b.reward_total, np.clip(total, -0.75, 0.75))
    assert b.reward_names == ["digit_ratio", "rm"] and b.rewards[1, 0] == 1.0
