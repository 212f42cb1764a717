"""`slurm-rlhf chat MODEL`: talk to a model, one turn per line (like DeepSpeed-Chat's chat script).

The conversation is rendered with the tokenizer's chat template, or as DeepSpeed-Chat's
"Human: ... Assistant:" text when the tokenizer has none. `clear` starts a new conversation; `quit`,
`exit` or end of input (Ctrl-D) ends. When the conversation grows past the model's length, its oldest
turns are dropped.
"""

from __future__ import annotations

import sys

from toolkit.errors import ConfigError
from toolkit.use.sampler import Sampler, Sampling


def render(tokenizer, turns: list[dict]) -> list[int]:
    from toolkit.data.tokens import render_prompt

    if getattr(tokenizer, "chat_template", None):
        return render_prompt(tokenizer, turns, True)
    text = "".join(f"{'Human' if t['role'] == 'user' else 'Assistant'}: {t['content']}\n\n" for t in turns)
    return list(tokenizer(text + "Assistant:")["input_ids"])


def chat(sampler: Sampler, params: Sampling, lines=sys.stdin, out=sys.stdout) -> int:
    """Answer each line of `lines`; the number of answers."""
    turns: list[dict] = []
    answers = 0
    budget = sampler.max_model_len - params.max_new_tokens
    if budget < 1:
        raise ConfigError(f"--max-new-tokens {params.max_new_tokens} leaves no room for the conversation in "
                          f"{sampler.max_model_len} tokens of context")
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
