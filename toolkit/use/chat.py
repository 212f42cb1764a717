"""`slurm-rlhf chat MODEL`: talk to a model, one turn per line (like DeepSpeed-Chat's chat script).

The conversation is rendered with the tokenizer's chat template, or as DeepSpeed-Chat's
"Human: ... Assistant:" text when the tokenizer has none. `clear` starts a new conversation; `quit`,
`exit` or end of input (Ctrl-D) ends. When the conversation grows past the model's length, its oldest
turns are dropped.
"""

from __future__ import annotations

import sys
from pathlib import Path

from toolkit.errors import ConfigError
from toolkit.use.sampler import Sampler, Sampling


def render(tokenizer, turns: list[dict]) -> list[int]:
    from toolkit.data.tokens import render_prompt

    if getattr(tokenizer, "chat_template", None):
        return render_prompt(tokenizer, turns, True)
    text = "".join(f"{'Human' if t['role'] == 'user' else 'Assistant'}: {t['content']}\n\n" for t in turns)
    return list(tokenizer(text + "Assistant:")["input_ids"])


def context_of(model: Path, params: Sampling, max_model_len: int | None) -> int:
    """The context `chat` starts its engine with (--max-model-len, else the model's own, at most 2048); ConfigError
    where it leaves --max-new-tokens no room for the conversation, before the engine loads (it was refused only
    after vLLM had started)."""
    from toolkit.use.sampler import default_context, over_context

    if max_model_len is not None and (takes := over_context(model, max_model_len)):
        raise ConfigError(f"--max-model-len {max_model_len} is more than the model takes: {takes}; give less, or "
                          "leave it out (the model's own, at most 2048)")
    context = max_model_len or default_context(model)
    if context - params.max_new_tokens < 1:
        given = "--max-model-len" if max_model_len else "the model's own, at most 2048"
        raise ConfigError(f"--max-new-tokens {params.max_new_tokens} leaves no room for the conversation in "
                          f"{context} tokens of context ({given}); give --max-new-tokens below {context}")
    return context


def chat(sampler: Sampler, params: Sampling, lines=sys.stdin, out=sys.stdout) -> int:
    """Answer each line of `lines` (the context checked by `context_of`); the number of answers."""
    turns: list[dict] = []
    answers = 0
    budget = sampler.max_model_len - params.max_new_tokens
    interactive = out.isatty() and lines is sys.stdin
    while True:
        if interactive:
            out.write("you> ")
            out.flush()
        line = lines.readline()
        if not line or line.strip() in ("quit", "exit"):
            return answers
        text = line.strip()
        if not text:
            continue
        if text == "clear":
            turns = []
            out.write("(new conversation)\n")
            continue
        turns.append({"role": "user", "content": text})
        prompt = render(sampler.tokenizer, turns)
        while len(prompt) > budget and len(turns) > 1:
            turns = turns[2:] if len(turns) > 2 else turns[1:]
            prompt = render(sampler.tokenizer, turns)
        prompt = prompt[-budget:]
        reply = sampler.sample([prompt], params, answers)[0][0]
        answer = reply.text.strip()
        turns.append({"role": "assistant", "content": answer})
        out.write(f"model> {answer}\n")
        out.flush()
        answers += 1
