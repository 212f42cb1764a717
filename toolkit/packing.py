"""Samples packed into one sequence, each sample's attention computed on its own: no padding computed.

`pack(input_ids, attention_mask)` lays the right-padded rows of a micro-batch end to end in one sequence
of L tokens, positions restarting at each sample. In a block `with inside(models, packed):` the models'
attention runs through `_attention`, which calls PyTorch's SDPA once per sample (causal, on that sample's
own queries and keys), so attention costs what the samples need and nothing attends across a boundary. The
projections and MLPs see only real tokens. A dense block-diagonal mask (what SFT's packing did, and what
transformers builds from restarting positions) would make attention grow with L squared instead.

Per-token tensors of the padded layout ([B, T-1], position t scoring token t+1) map to the packed layout
([1, L-1]) with `Packed.take` and back with `Packed.put`. The packed position at the last token of a
sample scores the next sample's first token: `Packed.inside_rows` is 0 there, and such positions are never
action positions, so losses and log-probs are those of the padded layout.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch

NAME = "slurm_rlhf_packed"  # the attention implementation registered with transformers while packed
# The sample bounds of the block `inside` runs, read by `_attention`. Not thread-local: on a GPU, autograd
# runs the backward pass, and activation checkpointing's forward pass again, on a thread of its own per
# device. A worker runs one training pass at a time (the weight-sync probe's pass, in a thread of its own,
# is not packed and runs after training).
_bounds: list[int] | None = None


@dataclass
class Packed:
    input_ids: torch.Tensor      # long [1, L]
    position_ids: torch.Tensor   # long [1, L]: 0, 1, ... within each sample
    bounds: list[int]            # sample k is tokens bounds[k]:bounds[k+1]
    rows: torch.Tensor           # long [L-1]: the padded row of each packed position
    cols: torch.Tensor           # long [L-1]: its position in that row (clamped to the row's last)
    inside_rows: torch.Tensor    # float [L-1]: 0 at each sample's last token (it would score the next sample)

    def take(self, padded: torch.Tensor) -> torch.Tensor:
        """[B, W] of the padded layout (W ≥ the longest sample - 1) to [1, L-1]."""
        return (padded[self.rows, self.cols] * self.inside_rows.to(padded.dtype))[None]

    def put(self, packed: torch.Tensor, width: int) -> torch.Tensor:
        """[1, L-1] back to [B, width] of the padded layout, zero where no packed position maps."""
        out = packed.new_zeros((len(self.bounds) - 1, width))
        keep = self.inside_rows.bool()
        out[self.rows[keep], self.cols[keep]] = packed[0, keep]
        return out


def pack(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> Packed:
    """The right-padded rows of `input_ids` [B, T] (real tokens where `attention_mask` is 1) in one sequence."""
    lengths = attention_mask.sum(1).tolist()
    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + int(n))
    keep = attention_mask.bool()
    ids = input_ids[keep][None]
    positions = torch.cat([torch.arange(int(n)) for n in lengths])[None]
    rows = torch.repeat_interleave(torch.arange(len(lengths)), torch.as_tensor(lengths))[:-1]
    cols = positions[0, :-1].clone()
    within = torch.ones(bounds[-1] - 1)
    within[torch.as_tensor(bounds[1:-1], dtype=torch.long) - 1] = 0
    cols.clamp_(max=max(input_ids.shape[1] - 2, 0))
    return Packed(ids, positions, bounds, rows, cols, within)


def model_inputs(input_ids: torch.Tensor, attention_mask: torch.Tensor, packing: bool, device=None
                 ) -> tuple[Packed | None, torch.Tensor, dict[str, torch.Tensor]]:
    """(the packed layout or None, input ids, the model's other keyword arguments) of right-padded rows:
    as they are, or with `packing` in one sequence (run the passes `inside` the packed layout); the ids
    and arguments on `device` where one is given (the packed layout stays where the rows are)."""
    if not packing:
        packed, ids, inputs = None, input_ids, {"attention_mask": attention_mask}
    else:
        packed = pack(input_ids, attention_mask)
        ids, inputs = packed.input_ids, {"position_ids": packed.position_ids}
    if device is not None:
        ids, inputs = ids.to(device), {k: v.to(device) for k, v in inputs.items()}
    return packed, ids, inputs


def _attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None,
               **kwargs):
    """transformers' attention interface ([1, H, L, D] in, [1, L, H, D] out): SDPA on each sample alone."""
    for name, what in (("softcap", "attention logit soft-capping"), ("s_aux", "attention sinks")):
        if kwargs.get(name) is not None:
            raise NotImplementedError(f"packing: {what} ({type(module).__name__}) is not supported; set "
                                      "model.packing (train.packing) to false")
    bounds = _bounds
    if key.shape[1] != query.shape[1]:  # grouped-query attention: each key/value head serves a group
        groups = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    window = kwargs.get("sliding_window") or getattr(module, "sliding_window", None)
    dropout = dropout if module.training else 0.0
    parts = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        q, k, v = query[:, :, a:b], key[:, :, a:b], value[:, :, a:b]
        if window and b - a > window:  # sliding window: keys at most `window - 1` back
            i = torch.arange(b - a, device=q.device)
            allowed = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < window)
            parts.append(torch.nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=allowed, dropout_p=dropout, scale=scaling))
        else:
            parts.append(torch.nn.functional.scaled_dot_product_attention(
                q, k, v, is_causal=True, dropout_p=dropout, scale=scaling))
    return torch.cat(parts, dim=2).transpose(1, 2).contiguous(), None


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, _attention)


def _configs(model) -> list:
    """The transformers configs of `model`'s own models (through DeepSpeed, peft and ScoreModel wrappers)."""
    from transformers import PreTrainedModel

    return [m.config for m in model.modules() if isinstance(m, PreTrainedModel)]


@contextmanager
def inside(models, packed: Packed | None):
    """Forward (and backward) passes of `models` on `packed` in this block attend within each sample. A
    backward pass belongs in the block too: activation checkpointing runs the forward pass again there.
    With `packed` None (padded rows) the models are left as they are."""
    if packed is None:
        yield
        return
    _register()
    configs = [c for m in models for c in _configs(m)]
    before = [c._attn_implementation for c in configs]
    for c in configs:
        c._attn_implementation = NAME
    global _bounds
    _bounds = packed.bounds
    try:
        yield
    finally:
        _bounds = None
        for c, name in zip(configs, before):
            c._attn_implementation = name
