"""vLLM on CPU with a step's prompts holding more tokens than one engine step takes (4096 on CPU): each
prompt is prefilled whole (chunked prefill rewinds a request's seeded generator, which CPU generators
cannot do: the generator failed with "CPU Generator does not use offset" on `init`'s starter config, and
`generate` on a file of 60 prompts of 60 numbers), and every sample is the one its seed gives, whatever
else is scheduled beside it: in a run's generator, and in the sampler of `generate`, `eval` and `chat`.

Each engine runs in a process of its own, as in a run: a vLLM engine changes the process it starts in
(its environment, which later test processes would inherit, torch.compile switched off, threads bound to
cores)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import REPO, example, write_config

pytestmark = pytest.mark.integration

PROMPTS = 32  # of 150 tokens: 4800 prompt tokens, more than the 4096 of one engine step


def prompts_of(stride: int) -> list[list[int]]:
    return [[3 + (i * stride + k) % 500 for k in range(150)] for i in range(PROMPTS)]


def engine_check(config: str) -> None:
    """A run's generator engine: all prompts at once, then three of them alone, with their seeds."""
    import torch

    from toolkit.config import load_config
    from toolkit.roles.engines.vllm_engine import VllmEngine

    engine = VllmEngine(load_config(config), torch.device("cpu"))
    try:
        prompts, seeds = prompts_of(7), list(range(1000, 1000 + PROMPTS))
        assert sum(map(len, prompts)) > engine.llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens
        together = engine.generate(prompts, seeds)
        assert [len(c.tokens) for c in together] == [6] * PROMPTS
        for i in (0, 17, 31):
            alone = engine.generate([prompts[i]], [seeds[i]])[0]
            assert alone.tokens == together[i].tokens
            assert max(abs(a - b) for a, b in zip(alone.logprobs, together[i].logprobs)) < 1e-4
    finally:
        engine.close()


def sampler_check(model: str) -> None:
    """The sampler of `generate` and `eval`: 2 samples of each prompt, then two prompts alone."""
    from toolkit.use.sampler import Sampler, Sampling

    sampler = Sampler(model, "vllm", 160, seed=3)
    try:
        prompts, params = prompts_of(11), Sampling(max_new_tokens=6, temperature=1.0, n=2)
        together = sampler.sample(prompts, params)
        assert [len(samples) for samples in together] == [2] * PROMPTS
        for i in (0, 31):
            alone = sampler.sample([prompts[i]], params, first_index=i)[0]  # (the seeds of prompt i, sample j)
            assert [s.token_ids for s in alone] == [s.token_ids for s in together[i]]
    finally:
        sampler.close()


def in_own_process(check: str, arg) -> None:
    done = subprocess.run([sys.executable, "-c", f"from tests.integration.test_vllm_prefill import {check}; "
                           f"{check}({str(arg)!r})"], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]


def test_prompts_beyond_one_engine_step_generate_the_samples_of_their_seeds(tiny, tmp_path):
    rollout = {"max_prompt_tokens": 160, "max_new_tokens": 6, "backend": "vllm", "ignore_eos": True}
    in_own_process("engine_check", write_config(tmp_path, example("tiny-grpo.yaml", tiny, rollout=rollout)))


def test_the_sampler_of_generate_and_eval_takes_them_too(tiny):
    in_own_process("sampler_check", tiny / "model")
