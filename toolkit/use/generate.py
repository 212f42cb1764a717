"""`slurm-rlhf generate MODEL --input prompts.jsonl --output samples.jsonl`: batch sampling.

Input: JSON Lines, one prompt per line: {"prompt": "text"} or {"prompt": [{"role", "content"}, ...]} (or
"messages" for the latter), with any other fields (or a .json array of such rows); `--prompt-key` names
another field, `--input-key` Alpaca's input, joined to a text prompt as `data.input_key` joins it.
Output: one line per sample, the input row's fields plus `sample` (0..n-1), `response`, `response_tokens`,
`finished` and `logprob`; an input row with a field of those names is refused (its value would be replaced
without a word: an SFT row's reference `response`, say). The output file is written under a temporary name
and renamed when complete, readable by its owner alone (mode 600, as a run's files and its report are).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from toolkit.errors import ConfigError
from toolkit.use.sampler import Sampler, Sampling, check_input, check_model

BATCH = 64  # prompts per engine call (vLLM schedules within it)
OUTPUT_FIELDS = ("sample", "response", "response_tokens", "finished", "logprob")  # added to each row's fields


def read_rows(path: str, prompt_key: str = "prompt", input_key: str | None = None
              ) -> list[tuple[str, dict, object]]:
    """(location, row, prompt) of each line of `path`, checked before any model or tokenizer loads, so a bad
    line is named at once (ConfigError naming the file and line)."""
    from toolkit.data.examples import with_input
    from toolkit.data.jsonl import rows

    check_input(path)
    found = []
    for row in rows(path):
        prompt = row.data.get(prompt_key, row.data.get("messages"))
        ok = isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in prompt))
        if not ok:
            got = json.dumps(prompt)[:80] if prompt is not None else f"no such field (fields: {sorted(row.data)})"
            raise ConfigError(f"{row.location}: expected {json.dumps(prompt_key)}: a string or a list of "
                              f"{{\"role\", \"content\"}} messages, got {got}; --prompt-key names the prompt's field")
        if (clash := next((k for k in OUTPUT_FIELDS if k in row.data), None)) is not None:
            raise ConfigError(f"{row.location}: field {json.dumps(clash)} is one that generate writes (each output "
                              f"line is the row's fields and {', '.join(OUTPUT_FIELDS)}), so its value would be "
                              f"replaced; rename it in the input (e.g. to \"reference_{clash}\"), or leave it out")
        found.append((row.location, row.data, with_input(prompt, row.data, input_key, row.location, "--input-key")))
    if not found:
        raise ConfigError(f"--input {path}: no prompts in it")
    return found


def read_prompts(found: list[tuple[str, dict, object]], tokenizer, chat_template: str
                 ) -> tuple[list[dict], list[list[int]]]:
    """The rows `read_rows` found and each row's prompt as token ids (ConfigError naming the line)."""
    from toolkit.data.tokens import render_prompt

    data, prompts = [], []
    for location, row, prompt in found:
        try:
            prompts.append(render_prompt(tokenizer, prompt, chat_template == "on"))
        except ValueError as e:
            raise ConfigError(f"{location}: {e}") from None
        if not prompts[-1]:  # (the engine would fail on it, after the model loaded, naming no line)
            raise ConfigError(f"{location}: the prompt {json.dumps(prompt)[:60]} is no tokens (this tokenizer adds no "
                              "begin-of-sequence token); give the row a prompt")
        data.append(row)
    return data, prompts


def generate(model: Path, input_path: str, output: str, params: Sampling, backend: str = "auto", seed: int = 0,
             chat_template: str = "auto", max_model_len: int | None = None, progress=None,
             prompt_key: str = "prompt", input_key: str | None = None, removed=lambda: None) -> int:
    """Sample every prompt of `input_path` (its `prompt_key` field, Alpaca's `input_key` joined) into `output`
    ('-': standard output); the number of samples. `removed`: where `model` is a live run's checkpoint that
    the run may remove (ModelSource.removed), what to say if it is gone when the model loads."""
    found = read_rows(input_path, prompt_key, input_key)
    try:
        check_model(model)
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(model))
        rows, prompts = read_prompts(found, tokenizer, chat_template)
        needed = max(len(p) for p in prompts) + params.max_new_tokens
        sampler = Sampler(model, backend, max_model_len or needed, seed, tokenizer=tokenizer)
    except Exception:
        if (why := removed()):  # (it named a missing tokenizer, or gave vLLM's traceback)
            raise ConfigError(why) from None
        raise
    out_path = None if output == "-" else Path(output).resolve()
    if out_path is not None:
        out_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = out_path.parent / f".{out_path.name}.tmp-{os.getpid()}"
        # (0o600 whatever the umask; O_NOFOLLOW: a link made in its place in a shared folder is not written through)
        out = os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600), "w",
                        encoding="utf-8")
    else:
        out = sys.stdout
    written = 0
    try:
        for first in range(0, len(prompts), BATCH):
            batch = sampler.sample(prompts[first:first + BATCH], params, first)
            for row, samples in zip(rows[first:first + BATCH], batch):
                for k, s in enumerate(samples):
                    out.write(json.dumps({**row, "sample": k, "response": s.text, "response_tokens": s.tokens,
                                          "finished": s.finished, "logprob": round(s.logprob, 6)},
                                         ensure_ascii=False) + "\n")
                    written += 1
            if progress is not None:
                done = min(first + BATCH, len(prompts))
                progress.step(f"sampled {done}/{len(prompts)} prompts", done, len(prompts), f"{written} samples")
        if out_path is not None:
            out.flush()
            os.fsync(out.fileno())
            out.close()
            os.replace(tmp, out_path)
    finally:
        if out_path is not None:
            out.close()
            if tmp.exists():
                tmp.unlink()
        sampler.close()
        if progress is not None:
            progress.close()
    return written
