"""GRPO's loss on one micro-batch (`toolkit/roles/update.py`): the KL coefficient it takes and a KL term that
stays finite at prompt and padding positions. The actor is the tiny Llama itself; the engine around it
does what DeepSpeed's does for this loss (forward, backward, step), since only the loss is under test here
(whole runs train under DeepSpeed in tests/integration)."""

from __future__ import annotations

import math

import torch

from tests.conftest import example, write_config
from tests.unit.test_samples_and_modeling import batch as make_batch
from toolkit.config import load_config
from toolkit.modeling import pad_samples, token_logprobs
from toolkit.roles.update import Experience, MicroBatch, _actor_micro_batch


class Engine:
    """The model with DeepSpeed's engine calls this loss makes: the gradients stay on the model."""

    def __init__(self, model):
        self.model = model

    def __call__(self, **inputs):
        return self.model(**inputs)

    def backward(self, loss, **_):
        loss.backward()

    def step(self):
        pass


def step_stats(tiny, tmp_path, kl_coef: float | None, **rollout) -> tuple[dict, torch.nn.Module]:
    from transformers import AutoModelForCausalLM

    cfg = load_config(write_config(tmp_path, example("tiny-grpo.yaml", tiny, rollout=rollout,
                                                     algorithm={"kl": {"coef": 0.01}})))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny / "model", dtype=torch.float32)
    padded = pad_samples(make_batch(prompts=([1, 2, 3, 4], [5]), responses=([6, 7], [8, 9, 10]), group=(0, 0)), 0)
    mask = padded.action_mask
    with torch.no_grad():  # (a reference near the policy on the responses, 0 outside them as the trainer has it)
        own = token_logprobs(model(input_ids=padded.input_ids, attention_mask=padded.attention_mask).logits,
                             padded.input_ids, cfg.rollout.temperature)
    ref = (own - 0.1) * mask
    exp = Experience(padded, torch.zeros_like(mask), ref, ref.clone(), torch.tensor([[1.0], [-1.0]]) * mask,
                     kl_coef=kl_coef)  # (old log-probs: the forward's own, written in at the update)
    stats: dict[str, float] = {}
    part = MicroBatch(padded, torch.arange(len(padded)), False, "cpu")
    _actor_micro_batch(exp, Engine(model), cfg, part, None, 0, None, stats.__setitem__, at_update=True)
    return stats, model


def test_grpo_takes_the_steps_kl_coefficient(tiny, tmp_path):
    """With algorithm.kl.adaptive the trainer's controller moves the coefficient and reports it, and the loss
    took the config's initial one all the same; a replay takes the one its record holds."""
    for coef in (None, 0.5):
        stats, _ = step_stats(tiny, tmp_path, coef)
        used = 0.01 if coef is None else coef
        assert math.isclose(stats["loss"], stats["pg_loss"] + used * stats["kl_loss"], rel_tol=1e-5), (coef, stats)


def test_the_kl_term_is_finite_where_the_prompt_is_unlikely(tiny, tmp_path):
    """At a prompt or padding position the reference log-prob is 0 and k3's exp(ref - logprob) overflowed
    once the policy's log-prob there fell below -88 (a low temperature gets there): the loss and every
    gradient were NaN."""
    stats, model = step_stats(tiny, tmp_path, None, temperature=0.01)
    assert all(math.isfinite(v) for v in stats.values()), stats
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
