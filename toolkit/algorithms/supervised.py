"""Losses of the supervised stages: SFT's language-modelling loss on response tokens, and the reward
model's pairwise loss. Pure tensor functions."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def response_lm_loss(logits: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss sum, token count): the cross-entropy of predicting each token where `loss_mask` is 1 (the
    response tokens), from the logits one position earlier. [B, T] ids and mask, [B, T, V] logits.

    The sum and count (not the mean) let a step average over all its tokens, whatever the micro-batches."""
    targets = input_ids[:, 1:]
    mask = loss_mask[:, 1:].to(torch.float32)
    losses = F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]), targets.reshape(-1),
                             reduction="none").view_as(mask)
    return (losses * mask).sum(), mask.sum()


def pairwise_loss(chosen: torch.Tensor, rejected: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Mean over pairs of -log sigmoid(r_chosen - r_rejected) (Bradley-Terry, as InstructGPT), with the
    pairs' accuracy (r_chosen > r_rejected) and mean margin (r_chosen - r_rejected)."""
    margin = chosen.float() - rejected.float()
    loss = -F.logsigmoid(margin).mean()
    with torch.no_grad():
        stats = {"accuracy": (margin > 0).float().mean(), "margin": margin.mean()}
    return loss, stats
