"""Whether LoRA's `target_modules` name layers of the model, checked before start-up.

peft refuses a list of which no name matches any layer, but skips a name that matches none beside one
that matches: a misspelt `v_prj` beside `q_proj` left the value projections without adapters, silently.
The names are first looked up among the weights the checkpoint stores (the headers of its safetensors
files: instant, no torch). A name not found there is looked up in the model as transformers builds it,
on the meta device (no weights read or allocated, at any size), which is what peft sees: a tied output
head that the checkpoint does not store, and layers that transformers renames as it loads a checkpoint,
are there. Only that second look imports torch and transformers (seconds).

A model whose input embedding and output head share one weight (`tie_word_embeddings`: GPT-2, Qwen2.5-0.5B,
Llama-3.2-1B, Gemma) cannot take an adapter on either: the generators (vLLM) and the exports get the plain
model with each adapter merged into its weight, and one weight cannot hold two: an adapter on the head was
dropped from them (its weight is the embedding's, under the embedding's name), one on the embedding was
merged into the head as well, so they computed another model than the trainer's.
"""

from __future__ import annotations

import json
from pathlib import Path


def lora_target_problem(path: str | Path, targets: list[str] | str, field: str) -> str | None:
    """Why LoRA `targets` (peft's target_modules: a layer's name or the end of it, or `all-linear`) would not
    all get adapters in the causal LM at `path`: a name that matches no layer, or only modules without a
    weight matrix (a norm's weight is a vector, a container such as self_attn holds layers, a rotary embedding
    has no weights: peft refused them at start-up)."""
    if targets == "all-linear":  # (peft leaves the output head out, and an embedding is no linear layer)
        return None
    if not targets:
        return f"{field}: an empty list gives no layer an adapter; name layers (e.g. [q_proj, v_proj]), or all-linear"
    return _untargeted_problem(path, targets, field) or _tied_problem(path, targets, field)


def _tied_problem(path: str | Path, targets: list[str], field: str) -> str | None:
    """Why an adapter cannot go on a target that names the tied input embedding or output head of `path`."""
    tied = tied_layers(path)
    hit = [t for t in targets if any(name == t or name.endswith(f".{t}") for name in tied)]
    if not hit:
        return None
    return (f"{field}: {', '.join(hit)} {'is' if len(hit) == 1 else 'are'} the input embedding or output head of "
            f"{path}, which share one weight (tie_word_embeddings): an adapter there unties them, and the merged "
            "model that the generators (vLLM) and the exports take cannot hold that (an adapter on the head was "
            "lost from it, one on the embedding went into the head too); leave "
            f"{'it' if len(hit) == 1 else 'them'} out (all-linear adapts neither)")


def _untargeted_problem(path: str | Path, targets: list[str], field: str) -> str | None:
    """Why a target of `targets` would get no adapter (see lora_target_problem)."""
    stored = stored_layers(path)
    # (a checkpoint may store names without the model's outer prefix, e.g. GPT-2's `transformer.`)
    if stored and all(any(matrix and (f".{layer}".endswith(f".{t}") or f".{t}".endswith(f".{layer}"))
                          for layer, matrix in stored.items()) for t in targets):
        return None
    layers = built_layers(path)
    if layers is None:
        return None
    kinds = {t: {kind for name, kind in layers.items() if name == t or name.endswith(f".{t}")} for t in targets}
    missing = [t for t, found in kinds.items() if not found]
    containers = [t for t, found in kinds.items() if "container" in found and "matrix" not in found]
    vectors = [t for t, found in kinds.items() if "vector" in found and not found & {"matrix", "container"}]
    bare = [t for t, found in kinds.items() if found == {"none"}]
    if not missing and not containers and not vectors and not bare:
        return None
    what = [f"{', '.join(missing)} {'is not a layer' if len(missing) == 1 else 'are not layers'} of {path}"] * bool(
        missing) + [f"{', '.join(vectors)} {'has' if len(vectors) == 1 else 'have'} no weight matrix (a norm's "
                    "weight is a vector, which LoRA cannot adapt)"] * bool(vectors)
    for t in containers:  # (e.g. self_attn: peft adapts the layers in it, named themselves)
        inside = [name for name, kind in layers.items()
                  if kind == "container" and (name == t or name.endswith(f".{t}"))]
        what.append(f"{t} holds layers but is no layer itself (name the layers in it: "
                    f"{', '.join(_ends(layers, inside))})")
    what += [f"{', '.join(bare)} {'has' if len(bare) == 1 else 'have'} no weights (LoRA adapts a layer's weight "
             "matrix)"] * bool(bare)
    few = len(missing) + len(containers) + len(vectors) + len(bare) == 1
    return (f"{field}: {'; '.join(what)}, so {'it' if few else 'they'} would get no adapter; its layers with a "
            f"weight matrix end in {', '.join(_ends(layers))} (or use all-linear)")


def _ends(layers: dict[str, str], within: list[str] | None = None) -> list[str]:
    """The last parts of the names of the layers with a weight matrix (inside the modules `within`)."""
    return sorted({name.rpartition(".")[2] for name, kind in layers.items() if kind == "matrix"
                   and not name.rpartition(".")[2].isdigit()
                   and (within is None or any(name.startswith(f"{outer}.") for outer in within))})


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


def built_layers(path: str | Path) -> dict[str, str] | None:
    """{module name: `matrix` (its weight is one), `vector` (a weight of another shape: a norm's), `container`
    (no weight of its own, but modules: self_attn, mlp) or `none` (no weights: rotary_emb, act_fn)} of the
    causal LM at `path` as transformers builds it, on the meta device; None where it cannot build it here (an
    architecture this version does not know)."""
    model = _built(path)
    return None if model is None else {name: _kind(module) for name, module in model.named_modules() if name}


def tied_layers(path: str | Path) -> list[str]:
    """The names of the input embedding and the output head of the causal LM at `path` where the two share one
    weight, else []; [] without a look at the model where its config.json says `tie_word_embeddings: false`."""
    try:
        if json.loads((Path(path) / "config.json").read_text(encoding="utf-8")).get("tie_word_embeddings") is False:
            return []
    except (OSError, ValueError, AttributeError):
        pass
    model = _built(path)
    if model is None:
        return []
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    if embedding is None or head is None or getattr(head, "weight", None) is not getattr(embedding, "weight", 0):
        return []
    names = {id(module): name for name, module in model.named_modules()}
    return [names[id(embedding)], names[id(head)]]


def _built(path: str | Path):
    """The causal LM at `path` as transformers builds it, on the meta device (no weights read or allocated);
    None where it cannot build it here (an architecture this version does not know)."""
    try:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained(path)
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config)
    except Exception:  # (the trainer then loads it, or names why it cannot)
        return None


def _kind(module) -> str:
    """What `module` is to LoRA (built_layers)."""
    ndim = getattr(getattr(module, "weight", None), "ndim", None)
    if ndim is not None:
        return "matrix" if ndim == 2 else "vector"
    return "container" if next(module.children(), None) is not None else "none"
