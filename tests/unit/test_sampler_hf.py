"""`generate`/`chat`/`eval` with transformers (`--backend hf`): every sample of a call in one batched
`generate`, each row drawing its tokens with its own seeded generator, so a row's sample is the one it
gets alone; the log-probs are the model's, and top-p keeps each token inside its nucleus."""

from __future__ import annotations

import pytest
import torch

from toolkit.use.sampler import Sampler, Sampling


@pytest.fixture(scope="module")
def sampler(tiny):
    return Sampler(tiny / "model", "hf", 64, seed=5)


def prompts(sampler) -> list[list[int]]:
    texts = ["1 2 3", "count to nine, then say hello", "hi"]  # (three lengths: the batch is padded on the left)
    return [sampler.tokenizer(t)["input_ids"] for t in texts]


def teacher_forced(sampler, prompt: list[int], response: list[int]) -> torch.Tensor:
    """float [len(response), vocab]: the model's log-probs at each response position, the sample alone."""
    with torch.no_grad():
        logits = sampler.model(input_ids=torch.tensor([prompt + response])).logits[0].float()
    return logits[len(prompt) - 1: len(prompt) + len(response) - 1].log_softmax(-1)


def test_each_row_samples_as_it_would_alone_with_the_models_logprobs(sampler):
    batch = sampler.sample(prompts(sampler), Sampling(max_new_tokens=12, temperature=1.0, n=3))
    assert [len(row) for row in batch] == [3, 3, 3]
    flat = [s for row in batch for s in row]
    assert len({tuple(s.token_ids) for s in flat}) == 9  # (no two rows share a random stream)
    for k, prompt in enumerate(prompts(sampler)):
        alone = sampler.sample([prompt], Sampling(max_new_tokens=12, temperature=1.0, n=3), first_index=k)[0]
        assert [s.token_ids for s in alone] == [s.token_ids for s in batch[k]]
        for s in batch[k]:
            assert 1 <= s.tokens == len(s.token_ids) <= 12
            assert s.finished == (s.token_ids[-1] == sampler.tokenizer.eos_token_id)
            forced = teacher_forced(sampler, prompt, s.token_ids)
            expected = float(forced.gather(-1, torch.tensor(s.token_ids)[:, None]).sum())
            assert s.logprob == pytest.approx(expected, abs=1e-3)
    again = sampler.sample(prompts(sampler), Sampling(max_new_tokens=12, temperature=1.0, n=3))
    assert [[s.token_ids for s in row] for row in again] == [[s.token_ids for s in row] for row in batch]


def test_top_p_keeps_every_token_inside_its_nucleus_and_greedy_takes_the_argmax(sampler):
    top_p = 0.3
    outside = 0
    for row, prompt in zip(sampler.sample(prompts(sampler), Sampling(max_new_tokens=12, temperature=1.0, top_p=top_p,
                                                                      n=4)), prompts(sampler)):
        for s in row:
            probs = teacher_forced(sampler, prompt, s.token_ids).exp()
            for position, token in enumerate(s.token_ids):
                p = probs[position]
                before = float(p[p > p[token]].sum())  # (the mass of the tokens ranked above it)
                outside += before >= top_p + 1e-4
    assert outside == 0
    for row, prompt in zip(sampler.sample(prompts(sampler), Sampling(max_new_tokens=12, temperature=0.0)),
                           prompts(sampler)):
        forced = teacher_forced(sampler, prompt, row[0].token_ids)
        assert forced.argmax(-1).tolist() == row[0].token_ids
