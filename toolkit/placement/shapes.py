"""Parameter counts of a model from its Hugging Face `config.json`, family by family, without building it.

The planner needs a model's size (weights, gradients, optimizer states, FLOPs) and its attention shape
(KV cache). Counting a Llama formula for every architecture made OPT-13B 17.3B parameters (+35%) and
OPT-350M +53%. Each family here counts what transformers builds: embeddings (tied or not), learned
positions, biases, norms, projections, and a mixture of experts' routers, experts and shared experts;
`active` is what one token passes through (the top-k experts), which is what costs FLOPs. The tests
check every family against the model transformers builds on the meta device, with config.json files of
public models.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from toolkit.errors import ConfigError


@dataclass(frozen=True)
class Linear:
    """Weight matrices LoRA may adapt (peft's `all-linear`: every linear layer but the output head): `copies`
    of an `inputs` x `outputs` matrix at `path` in a block. A mixture's experts are one parameter per layer
    in transformers 5 (each expert's gate and up projections fused, then the down projections), which peft
    0.21 adapts as one: an A of `ranks` x r rows (r per expert and per matrix fused) and one B over all
    outputs. `fused`: the projections' own names, which a target_modules list names (peft needs all of them)."""

    path: str
    inputs: int
    outputs: int
    copies: int
    ranks: int = 1
    fused: tuple[str, ...] = ()

    def named_by(self, target: str) -> bool:
        """Whether peft's `target_modules` entry `target` (a layer's name or the end of its path) names it."""
        names = [self.path] + [f"{self.path.rpartition('.')[0]}.{name}" for name in self.fused]
        return any(f".{name}".endswith(f".{target}") for name in names)

    def adapters(self, rank: int) -> int:
        return self.copies * rank * self.ranks * (self.inputs + self.outputs)


@dataclass(frozen=True)
class Count:
    total: float
    active: float
    layers: int
    hidden: int
    vocab: int
    kv_heads: int
    head_dim: int
    ffn: int  # the MLP's inner width (a mixture of experts: one expert's)
    linears: tuple[Linear, ...] = ()  # what LoRA may adapt
    lm_head: int = 0  # an output head of its own (untied from the embeddings): vocab x hidden, else 0
    score_inputs: int = 0  # what a value head (...ForSequenceClassification's score, one output) reads: hidden


def _attention(c: dict, h: int, heads: int, kv: int, hd: int, qkv_bias: bool, o_bias: bool) -> int:
    return (h * heads * hd + 2 * h * kv * hd + heads * hd * h
            + (heads * hd + 2 * kv * hd if qkv_bias else 0) + (h if o_bias else 0))


def _heads(c: dict) -> tuple[int, int, int, int]:
    h = c["hidden_size"]
    heads = c["num_attention_heads"]
    kv = c.get("num_key_value_heads") or heads
    hd = c.get("head_dim") or h // heads
    return h, heads, kv, hd


def _moe_layer(c: dict, i: int) -> bool:
    """Whether decoder layer `i` of a Qwen-style MoE config has experts (else a dense MLP)."""
    if i in (c.get("mlp_only_layers") or []):
        return False
    step = c.get("decoder_sparse_step") or 1
    return (i + 1) % step == 0


def _decoder(c: dict, family: str) -> Count:
    """Llama-like decoders: RMSNorm, rotary positions, gated MLP (Llama, Mistral, Qwen2/3, Gemma, and the
    mixtures of experts Mixtral, Qwen2-MoE, Qwen3-MoE)."""
    h, heads, kv, hd = _heads(c)
    layers, vocab = c["num_hidden_layers"], c["vocab_size"]
    qkv_bias = family in ("qwen2", "qwen2_moe") or bool(c.get("attention_bias"))
    o_bias = family in ("llama", "mistral", "qwen3", "qwen3_moe", "gemma", "gemma2") and bool(c.get("attention_bias"))
    norms = 4 * h if family == "gemma2" else 2 * h
    if family in ("qwen3", "qwen3_moe"):
        norms += 2 * hd  # q_norm and k_norm over each head
    attention = _attention(c, h, heads, kv, hd, qkv_bias, o_bias)
    dense_mlp = 3 * h * c.get("intermediate_size", 4 * h) + (
        2 * c.get("intermediate_size", 4 * h) + h if c.get("mlp_bias") else 0)
    total = active = 0.0
    linears: dict[tuple, int] = {}  # (path, inputs, outputs, ranks, fused): layers that have it

    def add(*matrices: tuple) -> None:
        for m in matrices:
            linears[m] = linears.get(m, 0) + 1

    def mlp(path: str, width: int) -> tuple:
        return ((f"{path}.gate_proj", h, width, 1, ()), (f"{path}.up_proj", h, width, 1, ()),
                (f"{path}.down_proj", width, h, 1, ()))

    for i in range(layers):
        total += attention + norms
        active += attention + norms
        add(("self_attn.q_proj", h, heads * hd, 1, ()), ("self_attn.k_proj", h, kv * hd, 1, ()),
            ("self_attn.v_proj", h, kv * hd, 1, ()), ("self_attn.o_proj", heads * hd, h, 1, ()))
        if family == "mixtral":
            experts, top = c["num_local_experts"], c["num_experts_per_tok"]
            expert = 3 * h * c["intermediate_size"]
            total += h * experts + experts * expert
            active += h * experts + top * expert
            width = c["intermediate_size"]
            add(("mlp.gate", h, experts, 1, ()), ("mlp.experts.gate_up_proj", h, 2 * width, 2 * experts, ("w1", "w3")),
                ("mlp.experts.down_proj", width, h, experts, ("w2",)))
        elif family in ("qwen2_moe", "qwen3_moe") and _moe_layer(c, i):
            experts, top = c["num_experts"], c["num_experts_per_tok"]
            expert = 3 * h * c["moe_intermediate_size"]
            shared = 0
            width = c["moe_intermediate_size"]
            if family == "qwen3_moe":  # (peft 0.21 maps no Qwen2-MoE names onto transformers 5's router and
                add(("mlp.gate", h, experts, 1, ()),  # experts, so it adapts neither there)
                    ("mlp.experts.gate_up_proj", h, 2 * width, 2 * experts, ("gate_proj", "up_proj")),
                    ("mlp.experts.down_proj", width, h, experts, ("down_proj",)))
            if family == "qwen2_moe" and c.get("shared_expert_intermediate_size"):
                shared = 3 * h * c["shared_expert_intermediate_size"] + h  # and its one-output gate
                add(*mlp("mlp.shared_expert", c["shared_expert_intermediate_size"]),
                    ("mlp.shared_expert_gate", h, 1, 1, ()))
            total += h * experts + experts * expert + shared
            active += h * experts + top * expert + shared
        else:
            total += dense_mlp
            active += dense_mlp
            add(*mlp("mlp", c.get("intermediate_size", 4 * h)))
    tied = c.get("tie_word_embeddings", family in ("gemma", "gemma2"))
    rest = vocab * h * (1 if tied else 2) + h  # embeddings (and LM head), final norm
    ffn = c.get("moe_intermediate_size") or c.get("intermediate_size", 4 * h)
    return Count(total + rest, active + rest, layers, h, vocab, kv, hd, ffn,
                 tuple(Linear(path, i, o, n, r, f) for (path, i, o, r, f), n in linears.items()),
                 vocab * h * (not tied), h)


def _opt(c: dict) -> Count:
    h, layers, vocab, ffn = c["hidden_size"], c["num_hidden_layers"], c["vocab_size"], c["ffn_dim"]
    proj = c.get("word_embed_proj_dim") or h
    bias = c.get("enable_bias", True)
    ln = 2 * h if c.get("layer_norm_elementwise_affine", True) else 0
    per_layer = 4 * (h * h + (h if bias else 0)) + h * ffn + h * ffn + ((ffn + h) if bias else 0) + 2 * ln
    positions = (c.get("max_position_embeddings", 2048) + 2) * h  # (OPT's learned positions start at offset 2)
    projections = 2 * h * proj if proj != h else 0
    final = ln if c.get("do_layer_norm_before", True) and not c.get("_remove_final_layer_norm", False) else 0
    tied = c.get("tie_word_embeddings", True)
    total = layers * per_layer + vocab * proj * (1 if tied else 2) + positions + projections + final
    heads = c["num_attention_heads"]
    linears = (*(Linear(f"self_attn.{name}", h, h, layers) for name in ("q_proj", "k_proj", "v_proj", "out_proj")),
               Linear("fc1", h, ffn, layers), Linear("fc2", ffn, h, layers))
    if proj != h:
        linears += (Linear("decoder.project_in", proj, h, 1), Linear("decoder.project_out", h, proj, 1))
    return Count(total, total, layers, h, vocab, heads, h // heads, ffn, linears, vocab * proj * (not tied), proj)


def _gpt2(c: dict) -> Count:
    h, layers, vocab = c["n_embd"], c["n_layer"], c["vocab_size"]
    inner = c.get("n_inner") or 4 * h
    per_layer = 2 * h + (3 * h * h + 3 * h) + (h * h + h) + 2 * h + (h * inner + inner) + (inner * h + h)
    tied = c.get("tie_word_embeddings", True)
    total = layers * per_layer + vocab * h * (1 if tied else 2) + c["n_positions"] * h + 2 * h
    heads = c["n_head"]
    linears = (Linear("attn.c_attn", h, 3 * h, layers), Linear("attn.c_proj", h, h, layers),
               Linear("mlp.c_fc", h, inner, layers), Linear("mlp.c_proj", inner, h, layers))
    return Count(total, total, layers, h, vocab, heads, h // heads, inner, linears, vocab * h * (not tied), h)


def _gpt_neox(c: dict) -> Count:
    h, layers, vocab = c["hidden_size"], c["num_hidden_layers"], c["vocab_size"]
    ffn = c.get("intermediate_size") or 4 * h
    bias = c.get("attention_bias", True)
    attention = 3 * h * h + h * h + (4 * h if bias else 0)  # query_key_value and dense
    per_layer = 4 * h + attention + (h * ffn + ffn) + (ffn * h + h)  # two layer norms, the MLP
    tied = c.get("tie_word_embeddings", False)
    total = layers * per_layer + vocab * h * (1 if tied else 2) + 2 * h
    heads = c["num_attention_heads"]
    linears = (Linear("attention.query_key_value", h, 3 * h, layers), Linear("attention.dense", h, h, layers),
               Linear("mlp.dense_h_to_4h", h, ffn, layers), Linear("mlp.dense_4h_to_h", ffn, h, layers))
    return Count(total, total, layers, h, vocab, heads, h // heads, ffn, linears, vocab * h * (not tied), h)


FAMILIES = {"llama": _decoder, "mistral": _decoder, "qwen2": _decoder, "qwen3": _decoder, "gemma": _decoder,
            "gemma2": _decoder, "mixtral": _decoder, "qwen2_moe": _decoder, "qwen3_moe": _decoder,
            "opt": _opt, "gpt2": _gpt2, "gpt_neox": _gpt_neox}


class NotCounted(ConfigError):
    """A family the planner does not count: `what` says which; the message adds what to give instead."""

    def __init__(self, what: str):
        super().__init__(f"{what}; give the model's size instead, e.g. --params actor=7e9 (and reference=, "
                         "critic=, reward=)")
        self.what = what


# The sizes the families above read: each, where given (not null), a whole number above 0.
SIZES = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "num_hidden_layers", "vocab_size",
         "intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size", "num_local_experts",
         "num_experts", "num_experts_per_tok", "decoder_sparse_step", "ffn_dim", "word_embed_proj_dim",
         "max_position_embeddings", "n_embd", "n_layer", "n_inner", "n_positions", "n_head")


def _size_problem(config: dict) -> str | None:
    """What is wrong with a size of `config` (see SIZES), or with how its heads split, if anything."""
    for key in SIZES:
        value = config.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            return f"{key} is {json.dumps(value)}"
    heads, kv = config.get("num_attention_heads"), config.get("num_key_value_heads")
    if heads and kv and heads % kv:
        return f"num_key_value_heads {kv} does not divide num_attention_heads {heads}"
    return None


def count(config: dict, source: str = "config.json") -> Count:
    """The parameter count and attention shape of the model a config.json describes (ConfigError for an
    architecture this does not know, saying what to pass instead, and for sizes that are no counts)."""
    if not isinstance(config, dict):
        raise ConfigError(f"{source}: a config.json is a JSON object of the model's settings (model_type, "
                          f"hidden_size, ...), not {type(config).__name__}")
    family = config.get("model_type")
    counter = FAMILIES.get(family)
    if counter is None:
        raise NotCounted(f"{source}: model_type {family!r} ({', '.join(config.get('architectures') or ['?'])}) "
                         f"is not one the planner counts ({', '.join(sorted(FAMILIES))})")
    sizes = {k: v for k, v in config.items() if k.startswith(("num_", "n_")) or k.endswith(("_size", "_dim"))}
    problem = _size_problem(config)
    if problem:
        raise ConfigError(f"{source}: a {family} config whose sizes are not all whole numbers above 0 ({problem}): "
                          f"{json.dumps(sizes)[:300]}")
    try:
        return counter(config, family) if counter is _decoder else counter(config)
    except KeyError as e:
        raise ConfigError(f"{source}: a {family} config needs {e.args[0]!r}, and this one has none") from None
    except (TypeError, ValueError, ZeroDivisionError) as e:  # (null where a count goes)
        raise ConfigError(f"{source}: a {family} config whose sizes are not all whole numbers above 0 ({e}): "
                          f"{json.dumps(sizes)[:300]}") from None
