"""Model helpers shared by every stage: padding ragged samples, token log-probs, score models (reward
models and critics) and dropout.

Layout: each sample is `prompt + response`, right-padded to [B, T]. Per-token quantities (log-probs,
values, advantages) live on [B, T-1]: position t scores token t+1, so response token j of a sample with
P prompt tokens sits at position P-1+j, and `action_mask` marks exactly those positions.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from toolkit.packing import inside, model_inputs


def torch_dtype(name: str) -> torch.dtype:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def without_dropout(path) -> dict:
    """`from_pretrained` keyword arguments that set every dropout probability of the model's config to 0.

    RL trains with dropout off (as TRL and OpenRLHF do): with it on, the trainer's log-probs of a sample
    would differ from the generator's at random, and the PPO ratio would measure noise. GPT-2 and OPT
    configs carry 0.1 by default."""
    from toolkit.config.model_files import model_config

    return {key: 0.0 for key, value in model_config(path).items()
            if ("dropout" in key or key.endswith("pdrop")) and isinstance(value, float) and value > 0}


def pretrained_kwargs(path, dtype: torch.dtype, attention: str = "sdpa", dropout: bool = False) -> dict:
    """`from_pretrained` keyword arguments of every model a stage loads: dtype, the attention
    implementation (`model.attn_implementation`) and, unless `dropout`, every dropout probability 0."""
    return {"dtype": dtype, "attn_implementation": attention, **({} if dropout else without_dropout(path))}


@dataclass
class Padded:
    input_ids: torch.Tensor        # long [B, T]
    attention_mask: torch.Tensor   # long [B, T]
    action_mask: torch.Tensor      # float [B, T-1]: 1 on positions that score response tokens
    prompt_lens: torch.Tensor      # long [B]
    response_lens: torch.Tensor    # long [B]

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def rows(self, index) -> "Padded":
        """The samples at `index`, trimmed to their longest sequence."""
        width = int(self.attention_mask[index].sum(1).max())
        return Padded(self.input_ids[index, :width], self.attention_mask[index, :width],
                      self.action_mask[index, : width - 1], self.prompt_lens[index], self.response_lens[index])


def pad_samples(batch, pad_id: int) -> Padded:
    """Right-pad `prompt + response` of every sample of a SampleBatch."""
    n = len(batch)
    p_lens = np.diff(batch.prompt_offsets)
    r_lens = np.diff(batch.response_offsets)
    width = int((p_lens + r_lens).max()) if n else 1
    ids = torch.full((n, width), pad_id, dtype=torch.long)
    attention = torch.zeros((n, width), dtype=torch.long)
    action = torch.zeros((n, max(width - 1, 1)), dtype=torch.float32)
    for i in range(n):
        p, r = int(p_lens[i]), int(r_lens[i])
        ids[i, :p] = torch.from_numpy(batch.prompt(i).astype(np.int64))
        ids[i, p: p + r] = torch.from_numpy(batch.response(i).astype(np.int64))
        attention[i, : p + r] = 1
        action[i, p - 1: p - 1 + r] = 1
    return Padded(ids, attention, action, torch.from_numpy(p_lens), torch.from_numpy(r_lens))


def scatter_responses(flat: np.ndarray, offsets: np.ndarray, padded: Padded) -> torch.Tensor:
    """Per-response-token values (flat, ragged) placed on the [B, T-1] action positions."""
    out = torch.zeros_like(padded.action_mask)
    for i in range(len(padded)):
        p, r = int(padded.prompt_lens[i]), int(padded.response_lens[i])
        out[i, p - 1: p - 1 + r] = torch.from_numpy(np.asarray(flat[offsets[i]: offsets[i + 1]], dtype=np.float32))
    return out


def gather_responses(values: torch.Tensor, padded: Padded) -> list[np.ndarray]:
    """The inverse of `scatter_responses`: each sample's response positions of a [B, T-1] tensor."""
    out = []
    for i in range(len(padded)):
        p, r = int(padded.prompt_lens[i]), int(padded.response_lens[i])
        out.append(values[i, p - 1: p - 1 + r].float().cpu().numpy())
    return out


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor, temperature: float) -> torch.Tensor:
    """log p(token_{t+1} | tokens_<=t) at `temperature`, [B, T-1], without materialising a log-softmax. (At
    temperature 1, the usual one, no division: it copied the logits, the largest tensor of a pass, for
    nothing; the peak memory beyond the logits of 8 x 2048 tokens, vocabulary 32000, was 3.91 GB, now 1.96.)"""
    logits = logits[:, :-1].float()
    if temperature != 1.0:
        logits = logits / temperature
    targets = input_ids[:, 1:]
    return logits.gather(-1, targets[..., None])[..., 0] - torch.logsumexp(logits, dim=-1)


@torch.no_grad()
def token_entropy(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Entropy of the next-token distribution at each position at `temperature`, [B, T-1] (a metric: no
    gradient)."""
    logprobs = torch.log_softmax(logits[:, :-1].float() / temperature, dim=-1)
    return -(logprobs.exp() * logprobs).sum(-1)


def by_length(lengths, batch_size: int) -> list[torch.Tensor]:
    """Indices of forward passes of at most `batch_size` samples, the longest samples together: each pass
    is padded only to its own longest sample, so samples of very different lengths waste little. The
    number of passes depends on the count alone (ZeRO-3 ranks must make the same number)."""
    order = torch.argsort(torch.as_tensor(lengths), descending=True, stable=True)
    return [order[start: start + batch_size] for start in range(0, len(order), batch_size)]


def per_position(model: nn.Module, padded: Padded, batch_size: int, fn, packing: bool = False) -> torch.Tensor:
    """[B, T-1] of `fn(model, input_ids, inputs)` over forward passes of `batch_size` samples of similar
    length (no gradients), zero outside the action positions. `inputs` are the model's other keyword
    arguments: the attention mask, or with `packing` the samples in one sequence (`toolkit.packing`)."""
    out = torch.zeros_like(padded.action_mask)
    device = next(model.parameters()).device
    with torch.no_grad():
        for index in by_length(padded.attention_mask.sum(1), batch_size):
            part = padded.rows(index)
            packed, ids, inputs = model_inputs(part.input_ids, part.attention_mask, packing, device)
            with inside([model], packed):
                values = fn(model, ids, inputs).float().cpu()
            if packed is not None:
                values = packed.put(values, part.action_mask.shape[1])
            out[index, : values.shape[1]] = values
    return out * padded.action_mask


def sequence_logprobs(model: nn.Module, padded: Padded, temperature: float, batch_size: int,
                      packing: bool = False) -> torch.Tensor:
    """`token_logprobs` of a causal LM for every sample. (`use_cache=False`: a config's `use_cache: true`, as
    most ship, made each pass build a KV cache of every layer, held to the pass's end for nothing: the peak
    memory of a pass over 8 x 2048 tokens of an 8-layer model went from +400 MB to +862 MB.)"""
    return per_position(model, padded, batch_size, lambda m, ids, inputs: token_logprobs(
        m(input_ids=ids, use_cache=False, **inputs).logits, ids, temperature), packing)


def critic_values(critic: nn.Module, padded: Padded, batch_size: int, packing: bool = False) -> torch.Tensor:
    """V(state after token t) of a ScoreModel on the action positions."""
    return per_position(critic, padded, batch_size, lambda m, ids, inputs: m(ids, **inputs)[:, :-1], packing)


class ScoreModel(nn.Module):
    """A sequence-classification model with one label (a reward model, or a critic) read at every
    position: forward returns scores [B, T], the score of the sequence up to each token.

    A reward model is the same network read at the last token of the response. Built from a reward
    model's directory it keeps the trained score head (PPO's critic starts from the reward model, as in
    DeepSpeed-Chat); from a causal LM's, the head is new (transformers initialises it, seeded)."""

    def __init__(self, path: str, dtype: torch.dtype, dropout: bool = False, attention: str = "sdpa"):
        super().__init__()
        import logging

        from transformers import AutoModelForSequenceClassification

        quiet = logging.getLogger("transformers.modeling_utils")
        level = quiet.level
        quiet.setLevel(logging.ERROR)  # "some weights ... newly initialized: ['score.weight']" is expected
        try:
            self.model = AutoModelForSequenceClassification.from_pretrained(
                path, num_labels=1, **pretrained_kwargs(path, dtype, attention, dropout))
        finally:
            quiet.setLevel(level)
        if getattr(self.model, "score", None) is None:
            raise ValueError(f"{path}: {type(self.model).__name__} has no `score` head; a reward model or critic "
                             "needs a sequence-classification model with one")
        if self.model.config.pad_token_id is None:
            self.model.config.pad_token_id = self.model.config.eos_token_id

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None) -> torch.Tensor:
        hidden = self.model.base_model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                       use_cache=False).last_hidden_state  # (no KV cache: see sequence_logprobs)
        return self.model.score(hidden).squeeze(-1).float()

    def gradient_checkpointing_enable(self, **kwargs) -> None:
        self.model.gradient_checkpointing_enable(**kwargs)


def last_token_scores(model: ScoreModel, sequences: list[list[int]], pad_id: int, batch_size: int,
                      device: torch.device, packing: bool = False) -> torch.Tensor:
    """float32 [N]: each sequence's score at its last token (no gradient), `batch_size` sequences of similar
    length at a time, right-padded, or with `packing` in one sequence (`toolkit.packing`)."""
    out = torch.zeros(len(sequences))
    with torch.no_grad():
        for index in by_length([len(s) for s in sequences], batch_size):
            part = [sequences[i] for i in index]
            packed, ids, inputs = model_inputs(*right_pad(part, pad_id), packing, device)
            with inside([model], packed):
                scores = model(ids, **inputs)
            if packed is None:
                rows, last = torch.arange(len(part)), torch.tensor([len(s) - 1 for s in part])
            else:
                rows, last = torch.zeros(len(part), dtype=torch.long), torch.tensor(packed.bounds[1:]) - 1
            out[index] = scores[rows.to(scores.device), last.to(scores.device)].float().cpu()
    return out


def right_pad(sequences: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask) [B, T] of token sequences padded on the right."""
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(sequences), width), dtype=torch.long)
    for i, s in enumerate(sequences):
        ids[i, : len(s)] = torch.tensor(s, dtype=torch.long)
        attention[i, : len(s)] = 1
    return ids, attention
