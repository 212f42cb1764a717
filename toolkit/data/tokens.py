"""From examples to token ids, the same way in every stage.

A prompt is rendered with the tokenizer's chat template when it is chat messages (or when
data.chat_template asks for it): the messages and the generation prompt of the assistant's turn; text
takes the tokenizer's BOS token, unless it starts with it (text the template rendered already). A
response is its text's tokens plus the end-of-sequence token, which the generator emits when a response
ends. Too long: the prompt loses its start first (the end is what the response answers; a BOS token
stays first); then the response loses its end (SFT) or its start (a reward model reads the last token).
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path


def counting_tokenizer(path):
    """The tokenizer at `path`, for counting tokens where nothing else needs transformers (the planner):
    from its tokenizer.json with transformers' generic fast class, whose import takes about 1 s here
    against 4-5 s for AutoTokenizer (which imports torch and every model's configuration). A
    model-specific class could add or drop a special token, so use it for estimates only; without a
    tokenizer.json, AutoTokenizer."""
    if (Path(path) / "tokenizer.json").is_file():
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(str(path))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def render_prompt(tokenizer, prompt, chat_template: bool) -> list[int]:
    """Token ids of a prompt (text, or chat messages [{role, content}, ...]): text with the tokenizer's special
    tokens (its BOS), unless it starts with the BOS token's text already."""
    if isinstance(prompt, list) or chat_template:
        messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"the tokenizer {tokenizer.name_or_path!r} has no chat template, so it cannot render "
                             "chat messages; give text prompts (and data.chat_template: false), or a tokenizer with one")
        ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # transformers 5 may return a BatchEncoding
            ids = ids["input_ids"]
        return list(ids)
    if tokenizer.bos_token and prompt.startswith(tokenizer.bos_token):
        # (text rendered with the chat template already, which writes the BOS token itself: the tokenizer's own
        # BOS made it two, which Llama-3 and Gemma models are not trained on)
        return list(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    return list(tokenizer(prompt)["input_ids"])


def response_ids(tokenizer, text: str) -> list[int]:
    """Token ids of a response, ending with one end-of-sequence token, as a generated one ends (a reward model
    reads a finished one at its EOS token too, whichever stop token ended it: `RewardRole._score_model`). A text
    that ends with special tokens already, with whitespace after them (data written by a chat template or for a
    trainer that did not add the end: "...</s>", Qwen's "...<|im_end|>\n", Gemma's "...<end_of_turn>\n"), ends
    with the one EOS token instead: SFT trained a second end after the first as a target, and a reward model read
    its reward there."""
    eos = tokenizer.eos_token_id
    if eos is not None:
        ends, stripped = special_texts(tokenizer), text.rstrip()
        while (end := next((s for s in ends if stripped.endswith(s)), None)) is not None:
            text = stripped[:-len(end)]  # (the whitespace before the first end token is the response's)
            stripped = text.rstrip()
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    return ids + [eos] if eos is not None else ids


@lru_cache(maxsize=8)
def special_texts(tokenizer) -> tuple[str, ...]:
    """The texts of the special tokens of `tokenizer` (its EOS, and every added token marked special: Gemma's
    <end_of_turn>, Llama-3's <|eot_id|>, Qwen's <|im_end|>); for each tokenizer once (Llama-3 has 256)."""
    specials = {t.content for t in tokenizer.added_tokens_decoder.values() if t.special} | {tokenizer.eos_token}
    return tuple(s for s in specials if s)


def text_ids(tokenizer, text: str) -> list[int]:
    """Token ids of a plain text row (PTX) as a pretraining document: the tokenizer's BOS, as a text prompt has
    it (`render_prompt`), the text, and one end-of-sequence token."""
    ids = render_prompt(tokenizer, text, False)
    eos = tokenizer.eos_token_id
    return ids + [eos] if eos is not None and ids[-1:] != [eos] else ids


def cut_left(tokens: list[int], n: int, bos: int | None) -> list[int]:
    """The last `n` of `tokens`, keeping the first where it is the BOS token `bos` (then it and the last n - 1):
    a model trained with BOS at position 0 (Llama, Gemma, Mistral) reads a sequence without it badly."""
    if len(tokens) <= n:
        return tokens
    if n > 1 and bos is not None and tokens[0] == bos:
        return tokens[:1] + tokens[len(tokens) - n + 1:]
    return tokens[len(tokens) - n:]


def fit(prompt: list[int], response: list[int], max_tokens: int, keep: str = "start", bos: int | None = None
        ) -> tuple[list[int], list[int]]:
    """Cut prompt + response to `max_tokens`: the prompt from the left first (after its BOS token `bos`, which
    stays where there is room for it: `cut_left`), then the response (keeping its `start` or its `end`)."""
    if len(prompt) + len(response) <= max_tokens:
        return prompt, response
    room = max_tokens - len(response)
    if room > 0:
        return cut_left(prompt, room, bos), response
    response = response[:max_tokens] if keep == "start" else response[len(response) - max_tokens:]
    return [], response
