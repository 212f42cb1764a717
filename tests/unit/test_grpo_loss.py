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
from toolkit.roles.update import Experience, MicroBatch, _actor_micro_batch, train_on


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

    def train(self, mode: bool = True):
        return self.model.train(mode)

    def eval(self):
        return self.model.eval()

    def parameters(self):
        return self.model.parameters()


def step_stats(tiny, tmp_path, kl_coef: float | None, whole_step: bool = False, trainer: dict | None = None,
               **rollout) -> tuple[dict, torch.nn.Module]:
    """The statistics of one micro-batch of two samples (`whole_step`: of `train_on` over them, in the
    micro-batches `trainer` settings make), and the model with its gradients."""
    from transformers import AutoModelForCausalLM

    cfg = load_config(write_config(tmp_path, example("tiny-grpo.yaml", tiny, rollout=rollout, trainer=trainer or {},
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
    if whole_step:
        exp.old_logprobs = None  # (the training forward's own, as GRPO with one update takes them)
        return train_on(exp, Engine(model), None, cfg, torch.Generator().manual_seed(0)), model
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


def test_a_steps_statistics_are_token_means_over_its_micro_batches(tiny, tmp_path):
    """Each micro-batch's token mean was averaged with the others' as one: a micro-batch of 2 tokens weighed
    as much as one of 40 (entropy 1.42 against 0.20 per response token in a review's case), and under a token
    budget the reported loss was not the one optimised (another sign there)."""
    from transformers import AutoModelForCausalLM

    from toolkit.modeling import token_entropy

    # micro-batches of one sample: responses of 2 and 3 tokens
    stats, _ = step_stats(tiny, tmp_path, None, whole_step=True, trainer={"micro_batch_size": 1})
    assert stats["micro_batches"] == 2 and stats["train_tokens"] == 5
    model = AutoModelForCausalLM.from_pretrained(tiny / "model", dtype=torch.float32)
    padded = pad_samples(make_batch(prompts=([1, 2, 3, 4], [5]), responses=([6, 7], [8, 9, 10]), group=(0, 0)), 0)
    with torch.no_grad():  # (the engine here takes no optimizer step: both micro-batches see these weights)
        entropy = token_entropy(model(input_ids=padded.input_ids, attention_mask=padded.attention_mask).logits, 1.0)
    mask = padded.action_mask
    assert abs(stats["entropy"] - float((entropy * mask).sum() / mask.sum())) < 1e-5, stats
    # on-policy, the policy loss of a token is minus its advantage: +1 on 2 tokens, -1 on 3, so (-2 + 3) / 5 per
    # token, where the mean of the two micro-batches' means gave 0
    assert abs(stats["pg_loss"] - 0.2) < 1e-6, stats
