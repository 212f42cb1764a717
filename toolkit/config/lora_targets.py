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
    all get adapters in the causal LM at `path`: a name that matches no layer, or only layers without a
    weight matrix (a norm's weight is a vector, which peft cannot adapt: it refused them at start-up)."""
    if targets == "all-linear":
        return None
    if not targets:
        return f"{field}: an empty list gives no layer an adapter; name layers (e.g. [q_proj, v_proj]), or all-linear"
    stored = stored_layers(path)
    # (a checkpoint may store names without the model's outer prefix, e.g. GPT-2's `transformer.`)
    if stored and all(any(matrix and (f".{layer}".endswith(f".{t}") or f".{t}".endswith(f".{layer}"))
                          for layer, matrix in stored.items()) for t in targets):
        return None
    layers = built_layers(path)
    if layers is None:
        return None
    matching = {t: [matrix for name, matrix in layers.items() if name == t or name.endswith(f".{t}")] for t in targets}
    missing = [t for t, found in matching.items() if not found]
    vectors = [t for t, found in matching.items() if found and not any(found)]
    if not missing and not vectors:
        return None
    ends = sorted({name.rpartition(".")[2] for name, matrix in layers.items()
                   if matrix and not name.rpartition(".")[2].isdigit()})
    what = [f"{', '.join(missing)} {'is not a layer' if len(missing) == 1 else 'are not layers'} of {path}"] * bool(
        missing) + [f"{', '.join(vectors)} {'has' if len(vectors) == 1 else 'have'} no weight matrix (a norm's "
                    "weight is a vector, which LoRA cannot adapt)"] * bool(vectors)
    few = len(missing) + len(vectors) == 1
    return (f"{field}: {'; '.join(what)}, so {'it' if few else 'they'} would get no adapter; its layers with a "
            f"weight matrix end in {', '.join(ends)} (or use all-linear)")


def stored_layers(path: str | Path) -> dict[str, bool]:
    """{layer: whether its weight is a matrix} of the weights the model directory's safetensors files store
    (from their headers: the file's, or each shard's of a sharded checkpoint); empty where there are none or
    they cannot be read."""
    directory = Path(path)
    try:
        index = directory / "model.safetensors.index.json"
        if index.is_file():
            files = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
        else:
            files = ["model.safetensors"]
        tensors = {}
        for name in files:
            with open(directory / name, "rb") as f:
                size = int.from_bytes(f.read(8), "little")
                tensors.update(json.loads(f.read(size)) if 0 < size < 1 << 28 else {})
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}
    layers: dict[str, bool] = {}
    for name, spec in tensors.items():
        if name != "__metadata__" and isinstance(spec, dict):
            layer, _, kind = name.rpartition(".")
            layers[layer] = layers.get(layer, False) or (kind == "weight" and len(spec.get("shape", ())) == 2)
    return layers


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
