"""Checking each weight sync: the generator must compute what the trainer computes.

A sync can look fine and still miss a weight: vLLM only logs "Failed to load weights" for a layer it
got nothing for, and a derived copy of a weight (the prepacked LM head of a model with tied embeddings
on CPU) can stay stale although every tensor arrived. So after every sync the generator scores a fixed
probe sequence with its engine and compares the log-probs with the ones the trainer computed from the
weights it sent. A mean difference above the tolerance fails the run with `WeightSyncError`.
"""

from __future__ import annotations

import torch

PROBE_LENGTH = 8  # every weight of the layers takes part at every position, so a few tokens check those;
# not every row of the input embedding (8 of them) nor every expert of a mixture (those the 8 tokens are
# routed to): a stale one of those passes (a review found it, 2026-12-07). Its forward pass is the part of
# a sync that the broadcast does not hide on a small model (tools/bench_sync.py)


class WeightSyncError(RuntimeError):
    """After a weight sync the generator's model differs from the trainer's."""


class TrainingDiverged(RuntimeError):
    """The trainer's weights hold nan or inf: what it sent is not worth generating from."""


def probe_tokens(vocab_size: int, seed: int, length: int = PROBE_LENGTH) -> list[int]:
    """A seeded sequence of token ids below `vocab_size` (the same on both sides: it travels at join)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (length,), generator=g).tolist()


@torch.no_grad()
def model_logprobs(model: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    """float32 [len(tokens) - 1]: log p(token t+1 | tokens <= t) of a causal LM at temperature 1, with every
    module in eval mode (as a generator computes; each module's own mode is put back after). A LoRA adapter's
    dropout (trainer.lora.dropout) is a module peft makes in training mode, inside a model loaded in eval
    mode: it dropped part of the probe's adapter input at random, and a sync that was exact failed the check
    (mean difference 0.01-0.02 at dropout 0.05 on the tiny Llama)."""
    from toolkit.modeling import token_logprobs

    device = next(model.parameters()).device
    ids = torch.tensor([tokens], device=device)
    modes = [(module, module.training) for module in model.modules()]
    try:
        model.eval()
        return token_logprobs(model(input_ids=ids).logits, ids, 1.0)[0].float().cpu()
    finally:
        for module, training in modes:
            module.training = training


def engine_logprobs(engine, tokens: list[int]) -> torch.Tensor:
    """The same from a generation engine (vLLM or transformers) through its `prompt_logprobs`."""
    steps = engine.prompt_logprobs(tokens)
    return torch.tensor([step[token] for step, token in zip(steps, tokens[1:])], dtype=torch.float32)


def check(expected: torch.Tensor, actual: torch.Tensor, tolerance: float, version: int, who: str) -> float:
    """The mean absolute difference; raises WeightSyncError when it is above `tolerance`, and TrainingDiverged
    when the trainer's own log-probs are not finite (no sync fault: the weights it sent hold nan or inf)."""
    if not bool(torch.isfinite(expected).all()):
        raise TrainingDiverged(
            f"after the update to policy_version {version}, the trainer's own log-probs on the probe sequence are "
            f"{expected.tolist()}: its weights hold nan or inf, so training diverged (the weight sync is not at "
            "fault). Look for inf or nan rewards or losses in metrics.jsonl, and start again with a lower "
            "trainer.lr (or a larger KL coefficient)")
    diff = float((expected - actual).abs().mean())
    if not diff <= tolerance:
        raise WeightSyncError(
            f"after the weight sync to policy_version {version}, {who} computes other log-probs than the trainer "
            f"on the probe sequence: mean |difference| {diff:.3g} > rollout.sync_check_tolerance {tolerance:g}. "
            "Some weights did not reach the generator (or reached it in the wrong layout), so its samples would "
            "come from a model that does not exist; look for 'Failed to load weights' or 'not loaded' in its "
            "log. Raise the tolerance only if the engines differ that much in this precision.")
    return diff
