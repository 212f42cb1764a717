"""Losses: PPO clipped policy loss, clipped value loss, and KL estimators. Token-mean over the mask."""

from __future__ import annotations

import math

import torch


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of `x` over positions where `mask` is 1 (0 when the mask is empty)."""
    mask = mask.to(x.dtype)
    if dim is None:
        return (x * mask).sum() / mask.sum().clamp(min=1)
    return (x * mask).sum(dim) / mask.sum(dim).clamp(min=1)


def policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                clip_eps: float, weights: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate: mean over tokens of -w * min(ratio * A, clip(ratio, 1 +- eps) * A), with
    ratio = exp(logprob - old_logprob) and w the per-token `weights` (1 when None).

    Stats: `clip_frac` (share of tokens where the clipped term was taken) and `approx_kl`
    (0.5 * (logprob - old_logprob)^2, between the policy and the one that made the data).
    """
    log_ratio = logprobs - old_logprobs
    ratio = torch.exp(log_ratio)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps) * advantages
    surrogate = torch.minimum(unclipped, clipped)
    if weights is not None:
        surrogate = weights * surrogate
    loss = masked_mean(-surrogate, mask)
    with torch.no_grad():
        stats = {"clip_frac": masked_mean((clipped < unclipped).to(logprobs.dtype), mask),
                 "approx_kl": masked_mean(0.5 * log_ratio**2, mask)}
    return loss, stats


def behaviour_weights(old_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, cap: float) -> torch.Tensor:
    """Per-token importance weights min(exp(old - behaviour), cap): how much likelier the policy at the
    update (`old`) makes a token than the policy that sampled it (truncated importance sampling, so a
    token the sampler found unlikely cannot dominate the loss). No gradient flows through them."""
    with torch.no_grad():
        return torch.exp(torch.clamp(old_logprobs - behaviour_logprobs, max=math.log(cap)))


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
               clip_eps: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """0.5 * mean over tokens of max((V - R)^2, (V_clipped - R)^2), V_clipped = V_old + clip(V - V_old, +-eps)."""
    clipped = old_values + torch.clamp(values - old_values, -clip_eps, clip_eps)
    loss = 0.5 * masked_mean(torch.maximum((values - returns) ** 2, (clipped - returns) ** 2), mask)
    with torch.no_grad():
        stats = {"value_clip_frac": masked_mean(((clipped - returns) ** 2 > (values - returns) ** 2).to(values.dtype),
                                                mask)}
    return loss, stats


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str = "k1") -> torch.Tensor:
    """Per-token KL(policy || reference) estimate from sampled tokens (Schulman, "Approximating KL").

    k1 = log p - log q (unbiased, can be negative); k2 = 0.5 (log p - log q)^2;
    k3 = q/p - 1 - log(q/p) (unbiased, always >= 0; used in the GRPO loss).
    """
    log_ratio = logprobs - ref_logprobs
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio**2
    if estimator == "k3":
        return torch.exp(-log_ratio) - 1 + log_ratio
    raise ValueError(f"unknown KL estimator {estimator!r}; use k1, k2 or k3")
