"""LoRA adapters (through peft) on a causal LM, and its weights as a plain model holds them.

Only the adapters train; the base weights stay frozen, so gradients and Adam states exist for the
adapters alone. In RL the reference model is the same network with its adapters disabled: no second
copy of the model anywhere.

What a generator gets at a weight sync, and what an export holds, is the merged weight
W + (alpha / r) B A under the base model's own parameter names: vLLM then serves a plain model, with no
LoRA kernels in its generation loop (vLLM's LoRA support needs a maximum rank and adapter slots, and
costs time per token), and the next stage of a pipeline reads an ordinary Hugging Face model. The price
is that a sync sends every weight, not only the adapters; the adapters alone are saved beside each
checkpoint's merged copy (`hf/adapter/`) for whoever wants them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

ADAPTER = "default"


def add_adapters(model: torch.nn.Module, section) -> torch.nn.Module:
    """`model` with LoRA adapters of `section` (a LoraSection) on its target linear layers; only they train.
    B starts at zero, so the adapted model equals the base model until the first update."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=section.rank, lora_alpha=section.alpha, lora_dropout=section.dropout,
                        target_modules=section.target_modules, bias="none", task_type="CAUSAL_LM")
    return get_peft_model(model, config, adapter_name=ADAPTER)


def has_adapters(model: torch.nn.Module) -> bool:
    from peft import PeftModel

    return isinstance(model, PeftModel)


@dataclass
class Weight:
    """One weight of the plain model: its name there, the tensor that holds it, and the adapter's update to
    add (None where no adapter sits)."""

    name: str
    param: torch.nn.Parameter
    delta: Callable[[], torch.Tensor] | None = None


def plain_weights(model: torch.nn.Module) -> list[Weight]:
    """The weights of `model` under the names of the plain model (for a model with adapters: the base
    model's names, each adapted weight merged); in `named_parameters` order, without the adapters."""
    if not has_adapters(model):
        return [Weight(name, p) for name, p in model.named_parameters()]
    base = model.get_base_model()
    out = []
    for name, p in base.named_parameters():
        if ".lora_" in name:
            continue
        if ".base_layer." not in name:
            out.append(Weight(name, p))
            continue
        owner, _, leaf = name.rpartition(".base_layer.")
        layer = base.get_submodule(owner)
        delta = (lambda layer=layer: layer.get_delta_weight(ADAPTER)) if leaf == "weight" else None
        out.append(Weight(f"{owner}.{leaf}", p, delta))
    return out


def merged_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The plain model's state dict of `model`: every weight with its adapter's update merged in."""
    return {w.name: w.param.data if w.delta is None else w.param.data + w.delta().to(w.param.dtype)
            for w in plain_weights(model)}


def plain_model(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model under the adapters (itself when there are none)."""
    return model.get_base_model() if has_adapters(model) else model


def parameter_counts(model: torch.nn.Module) -> tuple[int, int]:
    """(trainable, total) parameters (full counts under ZeRO-3, which partitions them)."""
    def count(p):
        return getattr(p, "ds_numel", p.numel())

    return sum(count(p) for p in model.parameters() if p.requires_grad), sum(count(p) for p in model.parameters())
