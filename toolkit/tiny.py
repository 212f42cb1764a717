"""Build a tiny Llama, tokenizer, reward model, prompt set and preference data offline, for demos and tests.

Nothing is downloaded: a byte-level BPE tokenizer (with a small chat template) is trained in memory on a
synthetic corpus, and the models are randomly initialised (seeded), so the same seed always gives the
same files. Layout of OUT_DIR:
    model/          LlamaForCausalLM + tokenizer (the actor, reference and critic backbone)
    reward_model/   LlamaForSequenceClassification (1 label) + tokenizer
    prompts.jsonl   {"prompt": ..., "topic": ...} per line
    pipeline.jsonl  {"prompt", "response", "chosen", "rejected"} per line: the synthetic task of the
                    pipeline demo (see `preference_rows`)
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Callable

from toolkit.flock import flock_held
from toolkit.newdir import build_beside, check_new

TOPICS = ["apples", "rivers", "stars", "trains", "music", "clocks", "maps", "birds", "games", "bridges",
          "coins", "lamps", "ships", "gardens", "storms", "books"]
TEMPLATES = ["Write about {t}:", "Tell me something about {t}.", "A short note on {t}:", "Numbers and {t}:",
             "Describe {t} in one line:", "Question about {t}?"]
LAYOUT_VERSION = "2"
BUILD_WAIT_S = 600.0  # (for another process building the same set: seconds on 2 idle cores)
# A chat template for the tiny tokenizer (chat rows of the data readers are rendered with it).
CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<s>assistant: {% endif %}")
WORDS = TOPICS + """the a of and to in is it that was for on are with as at be this have from or by one had not but what all were when we there can an your which their said if do will each about how up out them then she many some so these would other into has more her two like him see time could no make than first been its who now people my made over did down only way find use may water long little very after words called just where most know""".split()


def _corpus(rng: random.Random) -> list[str]:
    words = WORDS
    lines = []
    for _ in range(3000):
        n = rng.randint(4, 14)
        parts = []
        for _ in range(n):
            r = rng.random()
            if r < 0.15:
                parts.append(str(rng.randint(0, 10 ** rng.randint(1, 4))))
            elif r < 0.2:
                parts.append(rng.choice(",.:;!?"))
            else:
                parts.append(rng.choice(words))
        lines.append(" ".join(parts))
    return lines


def build_tokenizer(out: Path, seed: int = 0, vocab_size: int = 512):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_corpus(random.Random(seed)), trainer)
    # padding_side must be given to the constructor: an attribute set later is not saved.
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   padding_side="left", chat_template=CHAT_TEMPLATE)
    fast.save_pretrained(out)
    return fast


# Tiny random instances of the architecture families users bring, each with head size 64 (vLLM's CPU
# attention rejects 16) and 2 layers: {family: (config class, its arguments)}. `-tied` shares the input
# and output embeddings (as GPT-2, OPT, Gemma and the small Qwen2.5 / Llama-3.2 models do).
_SHAPE = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
              max_position_embeddings=512)
FAMILIES = {
    "llama": ("LlamaConfig", dict(_SHAPE, num_key_value_heads=1, tie_word_embeddings=False)),
    "mistral": ("MistralConfig", dict(_SHAPE, num_key_value_heads=1, sliding_window=None)),
    "qwen2": ("Qwen2Config", dict(_SHAPE, num_key_value_heads=1, tie_word_embeddings=False)),
    "qwen2-tied": ("Qwen2Config", dict(_SHAPE, num_key_value_heads=1, tie_word_embeddings=True)),
    "qwen3-tied": ("Qwen3Config", dict(_SHAPE, num_key_value_heads=1, head_dim=64, tie_word_embeddings=True)),
    "gemma-tied": ("GemmaConfig", dict(_SHAPE, num_key_value_heads=1, head_dim=64)),
    "gpt2-tied": ("GPT2Config", dict(n_embd=128, n_layer=2, n_head=2, n_positions=512)),
    "opt-tied": ("OPTConfig", dict(hidden_size=128, ffn_dim=256, num_hidden_layers=2, num_attention_heads=2,
                                   max_position_embeddings=512, word_embed_proj_dim=128)),
    "gpt-neox": ("GPTNeoXConfig", dict(_SHAPE, rotary_pct=0.25)),
    "qwen2-moe": ("Qwen2MoeConfig", dict(_SHAPE, num_key_value_heads=1, moe_intermediate_size=64,
                                         shared_expert_intermediate_size=128, num_experts=4, num_experts_per_tok=2)),
}


def build_family(out_dir: str | Path, family: str, seed: int = 0) -> Path:
    """A tiny random causal LM of `family` (see FAMILIES) with the tiny tokenizer, in `out_dir` (built beside it
    and moved in whole, replacing what is there: a build cut short leaves nothing half-written in its place)."""
    return _build_once(Path(out_dir), f"{LAYOUT_VERSION} {family} {seed}", lambda tmp: _build_family(tmp, family, seed))


def _build_family(out: Path, family: str, seed: int) -> None:
    import torch
    import transformers

    build_tokenizer(out, seed)
    class_name, args = FAMILIES[family]
    cfg = getattr(transformers, class_name)(**args)
    cfg.save_pretrained(out)
    # AutoTokenizer picks the family's tokenizer class from config.json, which may add tokens of its own
    # (Qwen2's adds <|endoftext|>): the vocabulary is what it loads.
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    cfg.update(dict(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                    eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id))
    torch.manual_seed(seed)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(out)
    (out / "BUILT").write_text(f"{LAYOUT_VERSION} {family} {seed}")


def build_tiny(out_dir: str | Path, seed: int = 0) -> Path:
    """Write the tiny model set into `out_dir` (skipped when already built with this seed). It is built beside
    it and moved in whole, and replaces only an empty directory or an earlier tiny model set."""
    return _build_once(Path(out_dir), f"{LAYOUT_VERSION} {seed}", lambda tmp: _build(tmp, seed), "tiny model set")


def _build_once(out: Path, built: str, build: Callable[[Path], None], new_only: str | None = None) -> Path:
    """`build` into `out` beside it (build_beside), unless its BUILT stamp says `built` already. Two processes
    that ask at once (two tests, two jobs) build it once: the second waits for the first under a flock on
    the directory that holds `out` (no lock file left anywhere), then finds the stamp. With `new_only` (what
    it is), `out` must be new or empty unless it holds an earlier build."""
    stamp = out / "BUILT"

    def done() -> bool:
        if stamp.exists() and stamp.read_text() == built:
            return True
        if new_only and not stamp.exists():
            check_new(out, str(out), new_only)
        return False

    if done():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)

    def timeout() -> RuntimeError:
        return RuntimeError(f"waited {BUILD_WAIT_S:.0f} s for another process to build {out} (it holds a flock on "
                            f"{out.parent}; `fuser {out.parent}` names it)")

    with flock_held(out.parent, BUILD_WAIT_S, timeout):
        if not done():
            build_beside(out, build)
    return out


def _build(out: Path, seed: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification

    stamp = out / "BUILT"
    tokenizer = build_tokenizer(out / "model", seed)
    build_tokenizer(out / "reward_model", seed)
    # head_dim = 128 / 2 = 64: vLLM's CPU attention rejects head_dim 16.
    cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=512,
                      bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                      pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False, dtype="float32")
    torch.manual_seed(seed)
    LlamaForCausalLM(cfg).save_pretrained(out / "model")
    cfg.num_labels = 1
    torch.manual_seed(seed + 1)
    LlamaForSequenceClassification(cfg).save_pretrained(out / "reward_model")

    rng = random.Random(seed)
    with open(out / "prompts.jsonl", "w") as f:
        for i in range(256):
            topic = TOPICS[i % len(TOPICS)]
            f.write(json.dumps({"prompt": rng.choice(TEMPLATES).format(t=topic), "topic": topic}) + "\n")
    with open(out / "pipeline.jsonl", "w") as f:
        for row in preference_rows(3000, seed):
            f.write(json.dumps(row) + "\n")
    stamp.write_text(f"{LAYOUT_VERSION} {seed}")


def set_eos_rate(model, rate: float) -> None:
    """Make end-of-sequence have probability `rate` at every position of a random Llama (`model`, in place),
    so that response lengths are geometric (mean about 1 / rate): residual dimension 0 holds the same value
    at every position (each token's embedding sets it, no layer writes into it), and the LM head's
    end-of-sequence row reads that dimension alone, so its logit is a constant, set against the other
    tokens' (near 0 in a random model)."""
    import math

    import torch

    config = model.config
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 2.0
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight[0].zero_()
            layer.mlp.down_proj.weight[0].zero_()
        seen = {}
        hook = model.model.norm.register_forward_hook(lambda _m, inputs, _o: seen.setdefault("x", inputs[0]))
        model(torch.randint(0, config.vocab_size, (8, 64)))
        hook.remove()
        x = seen["x"]
        normed = (x[..., 0] / x.pow(2).mean(-1).sqrt()).mean().item()  # dimension 0 after the final norm
        logit = math.log((config.vocab_size - 1) * rate / (1 - rate))
        model.lm_head.weight[config.eos_token_id].zero_()
        model.lm_head.weight[config.eos_token_id, 0] = logit / normed


def with_eos_rate(tiny: Path, out: Path, rate: float) -> Path:
    """A copy of the tiny model set's policy (`tiny`/model) in `out`, whose responses end at end-of-sequence
    with probability `rate` at every token (`set_eos_rate`): samples of different lengths, as real ones are."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny / "model", dtype=torch.float32)
    set_eos_rate(model, rate)
    model.save_pretrained(out)
    copy_tokenizer(tiny / "model", out)
    return out


def copy_tokenizer(model_dir: Path, out: Path) -> None:
    """The tokenizer files of `model_dir` into `out` (beside a model built from the same tokenizer)."""
    import shutil

    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (model_dir / name).exists():
            shutil.copy(model_dir / name, out / name)


def _response(rng: random.Random, digits: float) -> str:
    """A response of 6-12 words, each a number with probability `digits`."""
    return " ".join(str(rng.randint(0, 999)) if rng.random() < digits else rng.choice(WORDS)
                    for _ in range(rng.randint(6, 12)))


def preference_rows(n: int, seed: int) -> list[dict]:
    """The pipeline demo's synthetic task. Responses mix words and numbers, each response with its own
    density of numbers; the hidden preference is `toolkit.rewards.examples:digit_ratio` (the share of
    digits among the response's characters), which nothing in the prompt mentions. Every row has a
    prompt, a `response` to imitate (SFT) and a pair whose `chosen` response has clearly more digits
    than the `rejected` one (by at least 0.15 of digit_ratio)."""
    from toolkit.rewards.examples import digit_ratio

    rng = random.Random(f"{seed}:pipeline")
    rows = []
    while len(rows) < n:
        topic = rng.choice(TOPICS)
        a, b = (_response(rng, rng.uniform(0.0, 0.5)) for _ in range(2))
        ra, rb = digit_ratio("", a), digit_ratio("", b)
        if abs(ra - rb) < 0.15:
            continue
        chosen, rejected = (a, b) if ra > rb else (b, a)
        rows.append({"prompt": rng.choice(TEMPLATES).format(t=topic), "response": _response(rng, rng.uniform(0.0, 0.5)),
                     "chosen": chosen, "rejected": rejected, "topic": topic})
    return rows
