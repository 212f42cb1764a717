"""vLLM on CPU with a step's prompts holding more tokens than one engine step takes (4096 on CPU): each
prompt is prefilled whole (chunked prefill rewinds a request's seeded generator, which CPU generators
cannot do: the generator failed with "CPU Generator does not use offset" on `init`'s starter config, and
`generate` on a file of 60 prompts of 60 numbers), and every sample is the one its seed gives, whatever
else is scheduled beside it: in a run's generator, and in the sampler of `generate`, `eval` and `chat`."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import example, write_config
from toolkit.config import load_config

pytestmark = pytest.mark.integration


def test_prompts_beyond_one_engine_step_generate_the_samples_of_their_seeds(tiny, tmp_path):
    from toolkit.roles.engines.vllm_engine import VllmEngine

    rollout = {"max_prompt_tokens": 160, "max_new_tokens": 6, "backend": "vllm", "ignore_eos": True}
    cfg = load_config(write_config(tmp_path, example("tiny-grpo.yaml", tiny, rollout=rollout)))
    engine = VllmEngine(cfg, torch.device("cpu"))
    try:
        prompts = [[3 + (i * 7 + k) % 500 for k in range(150)] for i in range(32)]  # 4800 prompt tokens
        seeds = list(range(1000, 1032))
        assert sum(map(len, prompts)) > engine.llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens
        together = engine.generate(prompts, seeds)
        assert [len(c.tokens) for c in together] == [6] * 32
        for i in (0, 17, 31):  # the same sample alone, where nothing else is scheduled
            alone = engine.generate([prompts[i]], [seeds[i]])[0]
            assert alone.tokens == together[i].tokens
            assert max(abs(a - b) for a, b in zip(alone.logprobs, together[i].logprobs)) < 1e-4
    finally:
        engine.close()


def test_the_sampler_of_generate_and_eval_takes_them_too(tiny):
    from toolkit.use.sampler import Sampler, Sampling

    sampler = Sampler(tiny / "model", "vllm", 160, seed=3)
    try:
        prompts = [[3 + (i * 11 + k) % 500 for k in range(150)] for i in range(32)]  # 4800 prompt tokens
        params = Sampling(max_new_tokens=6, temperature=1.0, n=2)
        together = sampler.sample(prompts, params)
        assert [len(samples) for samples in together] == [2] * 32
        for i in (0, 31):
            alone = sampler.sample([prompts[i]], params, first_index=i)[0]  # (the seeds of prompt i, sample j)
            assert [s.token_ids for s in alone] == [s.token_ids for s in together[i]]
    finally:
        sampler.close()
