"""One policy update from one experience batch: old log-probs, values, advantages, then PPO-style epochs.

Runs on every trainer rank over its shard of the batch. GRPO and RLOO advantages need whole groups, so
they are computed from the full batch's rewards (every rank has them) and then sharded; PPO whitening
and REINFORCE++'s batch normalisation use statistics summed across ranks (`all_reduce`).

The loss departs from the textbook in the usual ways: token-mean over all response tokens of a
micro-batch; GRPO puts its KL term (k3 estimator) in the loss; PPO and REINFORCE++ put a k1 penalty on
every token's reward, RLOO on the sequence's reward (as its paper). With PTX, each micro-batch adds
`ptx.coef` times the language-modelling loss of a micro-batch of text (DeepSpeed-Chat's unsup_coef). In
asynchronous mode the samples come from older weights than the update's: the ratio stays against the
policy at the update (`old`, the proximal policy) and each token is weighted by the truncated importance
ratio of that policy to the one that sampled it (`behaviour_weights`; decoupled PPO).

GRPO with one update per batch (one epoch, `updates_per_step` 1, no behaviour correction) skips the
separate forward pass for the old log-probs: every micro-batch is forwarded before the optimizer steps,
so the policy at the update is the current one and `old` is the training forward's own log-probs,
detached (as TRL does with one iteration). They are then not in the committed record (the update needs
none); the training forward fills them in for the step's metrics. That pass was about a quarter of the
train time. The other algorithms need them before training (their rewards carry the KL penalty).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from toolkit.algorithms.advantages import (gae, grpo_advantages, kl_penalized_rewards, masked_whiten,
                                           reinforce_pp_advantages, rloo_advantages)
from toolkit.algorithms.losses import behaviour_weights, kl_estimate, masked_mean, policy_loss, value_loss
from toolkit.algorithms.supervised import response_lm_loss
from toolkit.modeling import (Padded, pad_samples, scatter_responses, sequence_logprobs, token_entropy,
                              token_logprobs)
from toolkit.packing import inside, model_inputs


@dataclass
class Experience:
    """The per-token tensors ([B, T-1]) one rank trains on. `old_logprobs` is None until training when
    they are the training forward's own (`old_at_update`)."""

    padded: Padded
    old_logprobs: torch.Tensor | None
    ref_logprobs: torch.Tensor
    behaviour_logprobs: torch.Tensor
    advantages: torch.Tensor
    values: torch.Tensor | None = None
    returns: torch.Tensor | None = None
    kl_coef: float | None = None  # GRPO: the KL coefficient of its loss, the step's (adaptive: as it was then)

    @property
    def mask(self) -> torch.Tensor:
        return self.padded.action_mask


def old_at_update(cfg) -> bool:
    """Whether the old log-probs are the training forward's own (see the module docstring)."""
    return cfg.old_logprobs_at_update


def make_experience(batch, shard_index: np.ndarray, actor, values_of: Callable[[Padded], torch.Tensor] | None,
                    cfg, kl_coef: float, pad_id: int, all_reduce: Callable[[torch.Tensor], torch.Tensor],
                    reference: Callable[[object], torch.Tensor] | None = None) -> Experience:
    """Experience for the samples `shard_index` of `batch` (a SampleBatch with rewards). A batch without
    reference log-probs gets them here, for the shard: from `reference` (the reference role of this
    worker, `ReferenceRole.logprobs`), or, with none (LoRA), from the actor with its adapters disabled.
    PPO: `values_of(padded)` gives the critic's values of the shard (its forward pass here, or what the
    critic's own rank computed)."""
    shard = batch.select(shard_index)
    padded = pad_samples(shard, pad_id)
    mask = padded.action_mask
    temperature = cfg.rollout.temperature
    batch_size, packing = cfg.model.forward_batch_size, cfg.model.packing
    old = None if old_at_update(cfg) else sequence_logprobs(actor, padded, temperature, batch_size, packing)
    if shard.ref_logprobs is None and reference is not None:
        ref = reference(padded)
    elif shard.ref_logprobs is None:  # LoRA: the reference model is the actor without its adapters
        with actor.module.disable_adapter():
            ref = sequence_logprobs(actor, padded, temperature, batch_size, packing)
    else:
        ref = scatter_responses(shard.ref_logprobs, shard.response_offsets, padded)
    behaviour = scatter_responses(shard.behaviour_logprobs, shard.response_offsets, padded)
    algo = cfg.algorithm
    total = torch.from_numpy(batch.reward_total.astype(np.float32))
    groups = torch.from_numpy(batch.group_index.astype(np.int64))
    mine = torch.from_numpy(shard_index)
    if cfg.run.algorithm == "grpo":
        per_sample = grpo_advantages(total, groups, algo.normalize_advantages)[mine]
        return Experience(padded, old, ref, behaviour, per_sample[:, None] * mask, kl_coef=kl_coef)
    if cfg.run.algorithm == "rloo":  # the KL of every sequence is needed for every group: summed over ranks
        kl = torch.zeros(len(batch))
        kl[mine] = ((old - ref) * mask).sum(1)
        per_sample = rloo_advantages(total - kl_coef * all_reduce(kl), groups)[mine]
        return Experience(padded, old, ref, behaviour, per_sample[:, None] * mask)
    rewards = kl_penalized_rewards(total[mine], old, ref, mask, kl_coef)
    if cfg.run.algorithm == "reinforce_pp":
        return Experience(padded, old, ref, behaviour, reinforce_pp_advantages(rewards, mask, algo.gamma, all_reduce))
    values = values_of(padded)
    advantages, returns = gae(rewards, values, mask, algo.gamma, algo.lam)
    if algo.normalize_advantages:
        advantages = masked_whiten(advantages, mask, all_reduce)
    return Experience(padded, old, ref, behaviour, advantages, values, returns)


def experience_from_record(record: dict, shard_index: np.ndarray, pad_id: int) -> Experience:
    """The Experience a rank trained on, rebuilt from a committed HDF5 record (`store.experience.read`):
    the same tensors, so training on it again gives the same update without generating anything."""
    from toolkit.store.experience import batch_of

    batch = batch_of(record)
    shard = batch.select(shard_index)  # shards are contiguous ranges of the batch
    padded = pad_samples(shard, pad_id)
    offsets = batch.response_offsets
    lo, hi = offsets[shard_index[0]], offsets[shard_index[-1] + 1]
    local = offsets[shard_index[0]: shard_index[-1] + 2] - lo
    stored = {**record["experience"], "ref_logprobs": batch.ref_logprobs, "behaviour_logprobs": batch.behaviour_logprobs}

    def place(name: str) -> torch.Tensor | None:
        return scatter_responses(stored[name][lo:hi], local, padded) if name in stored else None

    return Experience(padded, place("old_logprobs"), place("ref_logprobs"), place("behaviour_logprobs"),
                      place("advantages"), place("values"), place("returns"), kl_coef=record["attrs"]["kl_coef"])


# The statistics `train_on` can return: the actor's, the critic's (a rank training one of them returns
# its own), token means over the step's response tokens, and the two that every rank returns (PER_RANK);
# with `train_tokens`, the response tokens the token means are over.
STATS = ("pg_loss", "loss", "entropy", "clip_frac", "approx_kl", "kl_loss", "ptx_loss", "behaviour_weight",
         "behaviour_weight_capped", "value_loss", "value_clip_frac", "micro_batches", "padding_frac")
PER_RANK = ("micro_batches", "padding_frac")


def train_on(exp: Experience, actor, critic, cfg, shuffle_rng: torch.Generator, ptx=None,
             agree_max: Callable[[int], int] = lambda n: n,
             sum_ranks: Callable[[torch.Tensor], torch.Tensor] = lambda t: t, world: int = 1) -> dict[str, float]:
    """`algorithm.epochs` passes over the experience in micro-batches, `trainer.updates_per_step`
    optimizer steps each (see `micro_batches`). `ptx(i)` gives the i-th micro-batch of PTX text (ids,
    attention, loss mask) when the PTX mixture is on. `agree_max(n)`: the largest n over the trainer
    ranks (token-budget micro-batches: every rank runs as many); `sum_ranks(t)`: `t` summed over the `world`
    data-parallel ranks of the models (to weigh those micro-batches). Returns means of the loss statistics.
    The models are in training mode meanwhile (activation checkpointing acts only then; RL has no dropout).
    `actor` or `critic` may be None: a rank of one of them (the critic on ranks of its own) trains it on
    the same micro-batches, in the same order, as the other's rank of the same shard."""
    models = [m for m in (actor, critic) if m is not None]
    for m in models:
        m.train()
    try:
        return _epochs(exp, actor, critic, cfg, shuffle_rng, ptx, agree_max, sum_ranks, world)
    finally:
        for m in models:
            m.eval()


def micro_batches(exp: Experience, order: torch.Tensor, cfg, agree_max: Callable[[int], int]) -> list[list]:
    """The micro-batches of each optimizer update: `order` split into `updates_per_step` updates, each in
    `micro_batch_size` rows, or with `trainer.micro_batch_tokens` by token budget (`token_budget_batches`),
    as many on every rank (ZeRO's collectives run per forward and backward)."""
    trainer = cfg.trainer
    updates = [u.numpy() for u in order.chunk(trainer.updates_per_step)]
    if trainer.micro_batch_tokens is None:
        return [[u[i: i + trainer.micro_batch_size] for i in range(0, len(u), trainer.micro_batch_size)]
                for u in updates]
    lengths = exp.padded.attention_mask.sum(1).numpy()
    planned = [token_budget_batches(lengths, u, trainer.micro_batch_tokens, cfg.model.packing) for u in updates]
    return [split_to(batches, agree_max(len(batches))) for batches in planned]


def token_budget_batches(lengths: np.ndarray, index: np.ndarray, budget: int, packed: bool = False) -> list[np.ndarray]:
    """`index` in micro-batches of at most `budget` tokens, longest first: padded tokens (rows x the
    longest), or with `packed` the samples' own. A sample longer than the budget is a micro-batch of its own."""
    index = index[np.argsort(-lengths[index], kind="stable")]
    batches, start = [], 0
    while start < len(index):
        if packed:
            filled = np.cumsum(lengths[index[start:]])
            rows = max(1, int(np.searchsorted(filled, budget, side="right")))
        else:
            rows = max(1, budget // int(lengths[index[start]]))  # (the first is the longest)
        batches.append(index[start: start + rows])
        start += rows
    return batches


def _backward(engine, loss: torch.Tensor, share: float | None) -> None:
    """DeepSpeed's backward: the loss over gradient_accumulation_steps, or times `share` (token budget)."""
    if share is None:
        engine.backward(loss)
    else:
        engine.backward(loss * share, scale_wrt_gas=False)


def _planned(exp: Experience, updates: list[list], sum_ranks: Callable[[torch.Tensor], torch.Tensor], world: int):
    """(index, last of its update, its weight) of every micro-batch: its share of the response tokens of
    its update over every data-parallel rank, times `world` (DeepSpeed averages the ranks' gradients), so
    the update is the token mean of all its samples. (Each rank's own share made it a mean of the ranks'
    token means: a rank of short responses weighed as much as one of long ones, and the same samples
    trained differently on 1 rank and on 2.) One collective (`sum_ranks`) per call, on every rank."""
    tokens = [[float(exp.mask[torch.from_numpy(i)].sum()) for i in update] for update in updates]
    totals = sum_ranks(torch.tensor([sum(t) for t in tokens], dtype=torch.float64)).tolist()
    for update, counts, total in zip(updates, tokens, totals):
        for k, index in enumerate(update):
            yield torch.from_numpy(index), k == len(update) - 1, counts[k] * world / (total or 1.0)


def _rows(updates: list[list]):
    """(index, last of its update, None) of every micro-batch of `micro_batch_size` rows."""
    for update in updates:
        for k, index in enumerate(update):
            yield torch.from_numpy(index), k == len(update) - 1, None


def split_to(batches: list[np.ndarray], count: int) -> list[np.ndarray]:
    """`batches` with the one of most rows (the first of those: the longest) halved until there are `count`."""
    batches = list(batches)
    while len(batches) < count:
        i = max(range(len(batches)), key=lambda k: len(batches[k]))
        if len(batches[i]) < 2:
            raise ValueError(f"cannot split {sum(map(len, batches))} samples into {count} micro-batches")
        half = len(batches[i]) // 2
        batches[i: i + 1] = [batches[i][:half], batches[i][half:]]
    return batches


def _epochs(exp: Experience, actor, critic, cfg, shuffle_rng: torch.Generator, ptx, agree_max: Callable[[int], int],
            sum_ranks: Callable[[torch.Tensor], torch.Tensor], world: int) -> dict[str, float]:
    algo, trainer = cfg.algorithm, cfg.trainer
    n = len(exp.padded)
    sums: dict[str, float] = {}
    weights: dict[str, float] = {}
    count = real = computed = 0
    tokens = 0.0  # (the current micro-batch's response tokens)

    def add(name: str, value) -> None:
        """A micro-batch's token mean, weighted by its tokens: the step's figure is the token mean over its
        micro-batches (a mean of their means gave a micro-batch of 2 tokens the weight of one of 40)."""
        sums[name] = sums.get(name, 0.0) + float(value) * tokens
        weights[name] = weights.get(name, 0.0) + tokens

    at_update = actor is not None and exp.old_logprobs is None
    if at_update:  # filled in below from each micro-batch's training forward
        exp.old_logprobs = torch.zeros_like(exp.padded.action_mask)
    # By token budget, micro-batches differ in size: the update's boundary is set here, and each
    # micro-batch's token-mean loss is weighted by its share of the update's tokens over the ranks (instead
    # of DeepSpeed's 1 / gradient_accumulation_steps), so the loss is the token mean over the update.
    by_tokens = trainer.micro_batch_tokens is not None
    engines = [m for m in (actor, critic) if m is not None]
    for _ in range(algo.epochs):
        order = torch.randperm(n, generator=shuffle_rng) if trainer.updates_per_step > 1 or algo.epochs > 1 \
            else torch.arange(n)
        planned = micro_batches(exp, order, cfg, agree_max)
        for index, last, share in _planned(exp, planned, sum_ranks, world) if by_tokens else _rows(planned):
            if by_tokens:
                for engine in engines:
                    engine.set_gradient_accumulation_boundary(last)
            part = MicroBatch(exp.padded.rows(index), index, cfg.model.packing,
                              next(engines[0].parameters()).device)
            real += int(part.padded.attention_mask.sum())
            computed += part.ids.numel()
            tokens = float(part.mask.sum())
            with part.passes(engines):  # (forward and backward: activation checkpointing runs it again)
                if actor is not None:
                    _actor_micro_batch(exp, actor, cfg, part, ptx, count, share, add, at_update)
                if critic is not None:
                    values = critic(part.ids, **part.inputs)[:, :-1]
                    v_loss, v_stats = value_loss(values, part.take(exp.values), part.take(exp.returns), part.mask,
                                                 algo.value_clip_eps)
                    _backward(critic, v_loss, share)
                    critic.step()
                    add("value_loss", v_loss.item())
                    add("value_clip_frac", v_stats["value_clip_frac"])
            count += 1
    # (micro-batches of all epochs, and the share of the positions they computed that were padding)
    return {**{k: v / weights[k] if weights[k] else 0.0 for k, v in sums.items()}, "micro_batches": count,
            "padding_frac": 1 - real / max(computed, 1), "train_tokens": max(weights.values(), default=0.0)}


class MicroBatch:
    """The samples `index` of an experience as the models take them: padded rows, or with `packing` one
    sequence (`toolkit.packing`). `take` gives a per-token tensor of the experience ([B, T-1]) at this
    micro-batch's positions, `put` turns this micro-batch's per-token values back into padded rows."""

    def __init__(self, padded: Padded, index: torch.Tensor, packing: bool, device):
        self.padded, self.index, self.device = padded, index, device
        self.width = padded.action_mask.shape[1]
        self.packed, self.ids, self.inputs = model_inputs(padded.input_ids, padded.attention_mask, packing, device)
        self.mask = self.take_rows(padded.action_mask)

    def take_rows(self, rows: torch.Tensor) -> torch.Tensor:
        return (rows if self.packed is None else self.packed.take(rows)).to(self.device)

    def take(self, values: torch.Tensor) -> torch.Tensor:
        return self.take_rows(values[self.index, : self.width])

    def put(self, values: torch.Tensor) -> torch.Tensor:
        return values if self.packed is None else self.packed.put(values, self.width)

    def passes(self, models):
        """The block of this micro-batch's forward and backward passes (see `toolkit.packing.inside`)."""
        return inside(models, self.packed)


def _actor_micro_batch(exp: Experience, actor, cfg, part: MicroBatch, ptx, count: int, share: float | None,
                       add: Callable, at_update: bool) -> None:
    """The actor's forward, loss, backward and step on micro-batch `part` (count-th of the step), its
    statistics through `add`."""
    algo = cfg.algorithm
    ids, mask, device = part.ids, part.mask, part.device
    advantages, ref = part.take(exp.advantages), part.take(exp.ref_logprobs)
    old = None if at_update else part.take(exp.old_logprobs)
    weights = None
    if cfg.behaviour_correction:
        behaviour = part.take(exp.behaviour_logprobs)
        weights = behaviour_weights(old, behaviour, algo.behaviour_weight_cap)
        add("behaviour_weight", masked_mean(weights, mask).item())
        add("behaviour_weight_capped", masked_mean((weights >= algo.behaviour_weight_cap * (1 - 1e-6))
                                                   .to(weights.dtype), mask).item())
    logits = actor(input_ids=ids, **part.inputs).logits
    logprobs = token_logprobs(logits, ids, cfg.rollout.temperature)
    if at_update:
        old = logprobs.detach()
        exp.old_logprobs[part.index, : part.width] = part.put((old * mask).cpu())
    loss, stats = policy_loss(logprobs, old, advantages, mask, algo.clip_eps, weights)
    add("pg_loss", loss.item())
    kl_coef = algo.kl.coef if exp.kl_coef is None else exp.kl_coef  # (algorithm.kl.adaptive moves it)
    if cfg.run.algorithm == "grpo" and kl_coef > 0:
        # (k3 = exp(ref - logprob) - 1 + ...: at a prompt or padding position, where ref is 0, a log-prob
        # below -88 overflowed to inf, and inf x 0 of the mask made the loss and every gradient NaN)
        kl_term = masked_mean(kl_estimate(torch.where(mask.bool(), logprobs, ref), ref, "k3"), mask)
        loss = loss + kl_coef * kl_term
        add("kl_loss", kl_term.item())
    if ptx is not None:
        text_ids, text_attention, text_mask = (t.to(device) for t in ptx(count))
        total, tokens = response_lm_loss(actor(input_ids=text_ids, attention_mask=text_attention).logits,
                                         text_ids, text_mask)
        ptx_loss = total / tokens.clamp(min=1)
        loss = loss + cfg.ptx.coef * ptx_loss
        add("ptx_loss", ptx_loss.item())
    _backward(actor, loss, share)
    actor.step()
    add("loss", loss.item())
    add("entropy", masked_mean(token_entropy(logits, cfg.rollout.temperature), mask).item())
    add("clip_frac", stats["clip_frac"])
    add("approx_kl", stats["approx_kl"])
