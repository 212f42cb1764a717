"""Build a tiny Llama, tokenizer, reward model and prompt set offline, for demos and tests.

Nothing is downloaded: a byte-level BPE tokenizer is trained in memory on a small synthetic corpus,
and the models are randomly initialised (seeded), so the same seed always gives the same files.
Layout of OUT_DIR:
    model/          LlamaForCausalLM + tokenizer (the actor, reference and critic backbone)
    reward_model/   LlamaForSequenceClassification (1 label) + tokenizer
    prompts.jsonl   {"prompt": ..., "topic": ...} per line
"""

from __future__ import annotations

import json
import random
from pathlib import Path

TOPICS = ["apples", "rivers", "stars", "trains", "music", "clocks", "maps", "birds", "games", "bridges",
          "coins", "lamps", "ships", "gardens", "storms", "books"]
TEMPLATES = ["Write about {t}:", "Tell me something about {t}.", "A short note on {t}:", "Numbers and {t}:",
             "Describe {t} in one line:", "Question about {t}?"]
LAYOUT_VERSION = "1"


def _corpus(rng: random.Random) -> list[str]:
    words = TOPICS + "the a of and to in is it that was for on are with as at be this have from or by one had not but what all were when we there can an your which their said if do will each about how up out them then she many some so these would other into has more her two like him see time could no make than first been its who now people my made over did down only way find use may water long little very after words called just where most know".split()
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
                                   padding_side="left")
    fast.save_pretrained(out)
    return fast


def build_tiny(out_dir: str | Path, seed: int = 0) -> Path:
    """Write the tiny model set into `out_dir` (skipped when already built with this seed)."""
    out = Path(out_dir)
    stamp = out / "BUILT"
    if stamp.exists() and stamp.read_text() == f"{LAYOUT_VERSION} {seed}":
        return out
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification

    out.mkdir(parents=True, exist_ok=True)
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
    stamp.write_text(f"{LAYOUT_VERSION} {seed}")
    return out
