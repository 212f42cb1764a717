"""Whether LoRA's `target_modules` name layers of the model, checked before start-up.

peft refuses a list of which no name matches any layer, but skips a name that matches none beside one
that matches: a misspelt `v_prj` beside `q_proj` left the value projections without adapters, silently.
The names are first looked up among the weights the checkpoint stores (the headers of its safetensors
files: instant, no torch). A name not found there is looked up in the model as transformers builds it,
on the meta device (no weights read or allocated, at any size), which is what peft sees: a tied output
head that the checkpoint does not store, and layers that transformers renames as it loads a checkpoint,
are there. Only that second look imports torch and transformers (seconds).
"""

from __future__ import annotations

import json
from pathlib import Path


def lora_target_problem(path: str | Path, targets: list[str] | str, field: str) -> str | None:
    """Why LoRA `targets` (peft's target_modules: a layer's name or the end of it, or `all-linear`) would not
    all get adapters in the causal LM at `path`."""
    if targets == "all-linear":
        return None
    stored = stored_layers(path)
    # (a checkpoint may store names without the model's outer prefix, e.g. GPT-2's `transformer.`)
    if stored and all(any(f".{layer}".endswith(f".{t}") or f".{t}".endswith(f".{layer}") for layer in stored)
                      for t in targets):
        return None
    layers = built_layers(path)
    if layers is None:
        return None
    missing = [t for t in targets if not any(name == t or name.endswith(f".{t}") for name in layers)]
    if not missing:
        return None
    ends = sorted({name.rpartition(".")[2] for name, matrix in layers.items()
                   if matrix and not name.rpartition(".")[2].isdigit()})
    return (f"{field}: {', '.join(missing)} {'is not a layer' if len(missing) == 1 else 'are not layers'} of {path}, "
            f"so {'it' if len(missing) == 1 else 'they'} would get no adapter; its layers with a weight matrix end "
            f"in {', '.join(ends)} (or use all-linear)")


def stored_layers(path: str | Path) -> set[str]:
    """The layers whose weights the model directory's safetensors files store (from their headers, or the
    index of a sharded checkpoint); empty where there are none or they cannot be read."""
    directory = Path(path)
    try:
        index = directory / "model.safetensors.index.json"
        if index.is_file():
            names = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        else:
            with open(directory / "model.safetensors", "rb") as f:
                size = int.from_bytes(f.read(8), "little")
                names = json.loads(f.read(size)) if 0 < size < 1 << 28 else {}
    except (OSError, ValueError, KeyError, TypeError):
        return set()
    return {name.rpartition(".")[0] for name in names if name != "__metadata__"}


def built_layers(path: str | Path) -> dict[str, bool] | None:
    """{module name: whether it holds a weight matrix} of the causal LM at `path` as transformers builds it,
    on the meta device; None where it cannot build it here (an architecture this version does not know)."""
    try:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained(path)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except Exception:  # (the trainer then loads it, or names why it cannot)
        return None
    return {name: getattr(getattr(module, "weight", None), "ndim", 0) == 2 for name, module in model.named_modules()
            if name}
