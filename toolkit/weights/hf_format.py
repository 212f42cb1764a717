"""The form in which weights travel to a generator: the one its engine loads.

vLLM loads weights as `save_pretrained` writes them (the checkpoint format). transformers 5 keeps some
models differently in memory than on disk: a mixture-of-experts layer holds its experts fused in one
3-D tensor (`mlp.experts.gate_up_proj`), while the checkpoint has one matrix per expert
(`mlp.experts.3.gate_proj.weight`). Sending the in-memory tensors under their in-memory names leaves
vLLM's experts untouched, and vLLM only logs it. `checkpoint_converter` turns in-memory parameters into
the checkpoint's tensors with transformers' own conversion, the one `save_pretrained` applies.
"""

from __future__ import annotations

from typing import Callable

import torch

Converter = Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]


def identity(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return tensors


def checkpoint_converter(model: torch.nn.Module) -> Converter:
    """A function from {in-memory name: tensor} to {checkpoint name: tensor} for `model`'s parameters."""
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # transformers 4 keeps the checkpoint layout in memory
        return identity

    def convert(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return revert_weight_conversion(model, dict(tensors))

    return convert
