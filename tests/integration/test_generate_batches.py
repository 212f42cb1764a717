"""Transformers generation in batches (`rollout.generate_batch_size`): what lets a large model generate
beside its trainer's state, as DeepSpeed-Chat's per-device generation batch does."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import example, write_config
from toolkit.config import load_config

pytestmark = pytest.mark.integration


def engine(tiny, tmp_path, batch):
    from toolkit.roles.engines.hf_engine import HFEngine

    rollout = {"generate_batch_size": batch, "max_new_tokens": 12, "backend": "hf"}
    cfg = load_config(write_config(tmp_path / str(batch), example("tiny-grpo.yaml", tiny, rollout=rollout)))
    return HFEngine(cfg, torch.device("cpu"))


def test_batches_are_seeded_by_their_first_sample_and_score_their_own_tokens(tiny, tmp_path):
    prompts = [[5, 6, 7, 8]] * 4 + [[9, 10]] * 4
    seeds = list(range(100, 108))
    batched = engine(tiny, tmp_path, 3)
    first = batched.generate(prompts, seeds)
    assert len(first) == 8
    assert [c.tokens for c in batched.generate(prompts, seeds)] == [c.tokens for c in first]  # reproducible
    whole = engine(tiny, tmp_path, None)
    for start in (0, 3, 6):  # each batch of 3 is what one call with those samples alone gives
        alone = whole.generate(prompts[start:start + 3], seeds[start:start + 3])
        assert [c.tokens for c in alone] == [c.tokens for c in first[start:start + 3]]
        for a, b in zip(alone, first[start:start + 3]):
            assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-5
    # the log-probs are the model's own for the sampled tokens (teacher-forced, at temperature 1)
    model = whole.model
    sample = first[4]
    ids = torch.tensor([prompts[4] + sample.tokens])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompts[4]) - 1:-1].float().log_softmax(-1)
    forced = logits.gather(-1, torch.tensor(sample.tokens)[:, None])[:, 0]
    assert torch.allclose(forced, torch.tensor(sample.logprobs), atol=1e-4)
