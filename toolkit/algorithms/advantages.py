"""Advantages: group-relative (GRPO), GAE over a KL-penalised per-token reward (PPO), REINFORCE
leave-one-out (RLOO) and REINFORCE++.

Per-token tensors are [batch, positions] with a 0/1 `mask` that marks the response tokens; each row's
response is one contiguous span (prompt before it, padding after it).
"""

from __future__ import annotations

from typing import Callable

import torch


def grpo_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, normalize_std: bool = True,
                    eps: float = 1e-6) -> torch.Tensor:
    """A_i = (r_i - mean_g) / (std_g + eps) over the samples of i's group g (one advantage per sample).

    std is the sample standard deviation (Bessel-corrected, as TRL); a group of one sample gets 0, and so
    does a group whose rewards are all equal. DeepSeekMath's GRPO uses the same outcome advantage for every
    token of the response.

    Computed in float64, and such a group set to 0 exactly: in float32 the mean of 16 rewards of 0.7 missed
    0.7 by a rounding step, the std was made of the same rounding, and the group's advantages came out all
    +0.106 (2.7: all -0.319; 100.3 in 3 samples: all -0.738), pushing every sample one way on no signal.
    """
    values = rewards.double()
    _, inverse = torch.unique(group_ids, return_inverse=True)
    n_groups = int(inverse.max()) + 1 if len(inverse) else 0
    zeros = torch.zeros(n_groups, dtype=values.dtype, device=values.device)
    counts = zeros.index_add(0, inverse, torch.ones_like(values))
    mean = zeros.index_add(0, inverse, values) / counts
    centered = values - mean[inverse]
    if normalize_std:
        var = zeros.index_add(0, inverse, centered**2) / (counts - 1).clamp(min=1)
        centered = centered / (var.sqrt()[inverse] + eps)
    low = zeros.scatter_reduce(0, inverse, values, "amin", include_self=False)
    high = zeros.scatter_reduce(0, inverse, values, "amax", include_self=False)
    return torch.where((low == high)[inverse], 0.0, centered).float()


def last_token_index(mask: torch.Tensor) -> torch.Tensor:
    """Index of each row's last masked position (0 for an all-zero row)."""
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    return torch.where(mask.bool(), positions, torch.zeros_like(positions)).max(dim=1).values


def kl_penalized_rewards(scores: torch.Tensor, logprobs: torch.Tensor, ref_logprobs: torch.Tensor,
                         mask: torch.Tensor, kl_coef: float) -> torch.Tensor:
    """r_t = -kl_coef * (logprob_t - ref_logprob_t) on response tokens, plus the score on the last one."""
    rewards = -kl_coef * (logprobs - ref_logprobs) * mask
    rows = torch.arange(len(scores), device=scores.device)
    rewards[rows, last_token_index(mask)] += scores.to(rewards.dtype)
    return rewards


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float,
        lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016) over each row's response span.

    delta_t = r_t + gamma * V_{t+1} - V_t, with V = 0 after the last response token;
    A_t = delta_t + gamma * lam * A_{t+1}; returns_t = A_t + V_t. Zero outside the mask.
    """
    mask = mask.to(values.dtype)
    advantages = torch.zeros_like(values)
    running = torch.zeros_like(values[:, 0])
    next_value = torch.zeros_like(values[:, 0])
    for t in reversed(range(values.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        running = (delta + gamma * lam * running) * mask[:, t]
        advantages[:, t] = running
        next_value = values[:, t] * mask[:, t]
    return advantages, (advantages + values) * mask


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
                  eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / std over masked entries; `all_reduce` sums statistics across data-parallel ranks. The
    statistics are in float64: E[x²] - mean² in float32 lost the variance where the spread is small against
    the mean (returns of saturated rewards, an offset reward model; std 0.001 around 5 came out 0.72)."""
    wide, mask = x.double(), mask.double()
    stats = torch.stack([(wide * mask).sum(), (wide * wide * mask).sum(), mask.sum()])
    if all_reduce is not None:
        stats = all_reduce(stats)
    total, total_sq, count = stats
    mean = total / count.clamp(min=1)
    var = (total_sq / count.clamp(min=1) - mean**2).clamp(min=0)
    return ((wide - mean) * torch.rsqrt(var + eps) * mask).to(x.dtype)


def rloo_advantages(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """A_i = r_i - mean of the other samples of i's group (Ahmadian et al. 2024, "Back to Basics"): the
    leave-one-out baseline, equal to k/(k-1) (r_i - mean_g) for a group of k. One advantage per sample
    (for every token of its response); a group of one sample gets 0. `rewards` are sequence rewards,
    KL-penalised by the caller as the paper does (r - beta * KL of the sequence).

    Computed in float64, as `grpo_advantages`: in float32 a group of four rewards of 12345.7 got advantages of
    -0.00098 each (sum - r_i rounded), a push on no signal."""
    rewards = rewards.double()
    _, inverse = torch.unique(group_ids, return_inverse=True)
    n_groups = int(inverse.max()) + 1 if len(inverse) else 0
    zeros = torch.zeros(n_groups, dtype=rewards.dtype, device=rewards.device)
    counts = zeros.index_add(0, inverse, torch.ones_like(rewards))[inverse]
    sums = zeros.index_add(0, inverse, rewards)[inverse]
    others = (sums - rewards) / (counts - 1).clamp(min=1)
    return torch.where(counts > 1, rewards - others, torch.zeros_like(rewards)).float()


def reinforce_pp_advantages(token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0,
                            all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """REINFORCE++ (Hu 2025, arXiv 2501.03262): the return G_t = sum_{s >= t} gamma^(s-t) r_s of a per-token
    reward (KL penalty on every token, the score on the last: `kl_penalized_rewards`), normalised over
    every response token of the whole batch (global batch normalisation instead of a critic or a group)."""
    mask = mask.to(token_rewards.dtype)
    returns = torch.zeros_like(token_rewards)
    running = torch.zeros_like(token_rewards[:, 0])
    for t in reversed(range(token_rewards.shape[1])):
        running = (token_rewards[:, t] + gamma * running) * mask[:, t]
        returns[:, t] = running
    return masked_whiten(returns, mask, all_reduce)
