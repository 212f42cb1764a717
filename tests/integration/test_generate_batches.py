"""Transformers generation in batches (`rollout.generate_batch_size`): what lets a large model generate
beside its trainer's state, as DeepSpeed-Chat's per-device generation batch does."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import example, write_config
from toolkit.config import load_config

pytestmark = pytest.mark.integration


def engine(tiny, tmp_path, batch, **sampling):
    from toolkit.roles.engines.hf_engine import HFEngine

    rollout = {"generate_batch_size": batch, "max_new_tokens": 12, "backend": "hf", **sampling}
    name = f"{batch}-" + "-".join(f"{k}{v}" for k, v in sampling.items())
    cfg = load_config(write_config(tmp_path / name, example("tiny-grpo.yaml", tiny, rollout=rollout)))
    return HFEngine(cfg, torch.device("cpu"))


def test_each_sample_is_drawn_from_its_own_seed_whatever_the_batches(tiny, tmp_path):
    """Batches of 3, all 8 samples at once and each sample alone draw the same tokens with the same
    log-probs (each row from its own seed, as vLLM draws each request), and the global random state,
    which a trainer in the same process draws from, is left as it was."""
    prompts = [[5, 6, 7, 8]] * 4 + [[9, 10]] * 4
    seeds = list(range(100, 108))
    batched = engine(tiny, tmp_path, 3)
    rng = torch.get_rng_state()
    first = batched.generate(prompts, seeds)
    assert torch.equal(torch.get_rng_state(), rng)
    assert len(first) == 8 and len({tuple(c.tokens) for c in first}) == 8
    assert [c.tokens for c in batched.generate(prompts, seeds)] == [c.tokens for c in first]  # reproducible
    whole = engine(tiny, tmp_path, None)
    for got in (whole.generate(prompts, seeds), [whole.generate([p], [s])[0] for p, s in zip(prompts, seeds)]):
        assert [c.tokens for c in got] == [c.tokens for c in first]
        for a, b in zip(got, first):
            assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-5
    # the log-probs are the model's own for the sampled tokens (teacher-forced, at temperature 1)
    model = whole.model
    sample = first[4]
    ids = torch.tensor([prompts[4] + sample.tokens])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompts[4]) - 1:-1].float().log_softmax(-1)
    forced = logits.gather(-1, torch.tensor(sample.tokens)[:, None])[:, 0]
    assert torch.allclose(forced, torch.tensor(sample.logprobs), atol=1e-4)


def test_below_temperature_1_and_in_a_nucleus_the_logprobs_are_those_of_what_was_drawn_from(tiny, tmp_path):
    """At temperature 0.7 and top-p 0.8 each behaviour log-prob is the token's under the distribution it
    was drawn from (the model's at that temperature, cut to the nucleus and renormalised: vLLM's
    processed log-probs), and every drawn token lies inside its nucleus."""
    hot = engine(tiny, tmp_path, None, temperature=0.7, top_p=0.8)
    prompts = [[5, 6, 7, 8], [9, 10], [11, 12, 13]]
    for prompt, sample in zip(prompts, hot.generate(prompts, [1, 2, 3])):
        with torch.no_grad():
            logits = hot.model(torch.tensor([prompt + sample.tokens])).logits[0, len(prompt) - 1:-1].float()
        probs = torch.softmax(logits / 0.7, -1)
        for position, token in enumerate(sample.tokens):
            p = probs[position]
            ranked = p.sort(descending=True).values
            kept = ranked[(ranked.cumsum(0) - ranked) < 0.8]  # (the nucleus)
            assert float(p[p > p[token]].sum()) < 0.8 + 1e-4  # (inside it)
            assert sample.logprobs[position] == pytest.approx(float((p[token] / kept.sum()).log()), abs=1e-4)


def test_the_models_own_generation_config_changes_nothing_and_ignore_eos_goes_past_eos(tiny, tmp_path):
    """transformers fills what a GenerationConfig leaves unset from the model's own generation_config: a
    repetition penalty there must not change the samples, and with rollout.ignore_eos its end-of-sequence
    token must not end a row (it did: the rest of the row was padding, its log-probs not the model's)."""
    plain = engine(tiny, tmp_path, None)
    prompts, seeds = [[5, 6, 7, 8], [9, 10], [11, 12, 13]], [1, 2, 3]
    before = [c.tokens for c in plain.generate(prompts, seeds)]
    plain.model.generation_config.repetition_penalty = 3.0
    plain.model.generation_config.no_repeat_ngram_size = 1
    assert [c.tokens for c in plain.generate(prompts, seeds)] == before
    assert plain.model.generation_config.repetition_penalty == 3.0  # (put back)

    full = engine(tiny, tmp_path, None, ignore_eos=True, max_new_tokens=64)
    eos, pad = full.tokenizer.eos_token_id, full.pad_id
    assert full.model.generation_config.eos_token_id == eos  # (what transformers would have stopped at)
    samples = full.generate(prompts, seeds)
    assert all(len(c.tokens) == 64 and not c.finished for c in samples)
    past = [c.tokens[c.tokens.index(eos) + 1:] for c in samples if eos in c.tokens[:-1]]
    assert past and all(any(t != pad for t in rest) for rest in past)  # (it went on sampling after EOS)
    for prompt, c in zip(prompts, samples):
        with torch.no_grad():
            logits = full.model(torch.tensor([prompt + c.tokens])).logits[0, len(prompt) - 1:-1].float()
        forced = logits.log_softmax(-1).gather(-1, torch.tensor(c.tokens)[:, None])[:, 0]
        assert torch.allclose(forced, torch.tensor(c.logprobs), atol=1e-4)
