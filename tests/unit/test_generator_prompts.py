"""The generator's prompts: rendered with the run's tokenizer, cut from the left to rollout.max_prompt_tokens,
with one warning for the prompts of a message (a data set of long prompts would otherwise fill the log)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

from transformers import AutoTokenizer

from tests.conftest import example, write_config
from toolkit.config import load_config
from toolkit.data.tokens import render_prompt
from toolkit.roles.generator import GeneratorRole


def test_long_prompts_are_cut_from_the_left_with_one_warning_a_message(tiny, tmp_path, caplog):
    cfg = load_config(write_config(tmp_path, example("tiny-grpo.yaml", tiny, rollout={"max_prompt_tokens": 6})))
    role = GeneratorRole(SimpleNamespace(cfg=cfg, status={}))
    role.tokenizer, role.truncated = AutoTokenizer.from_pretrained(cfg.tokenizer_path), 0
    texts = ["the river runs past the mill and on to the sea", "hi", "a b c d e f g h i j k l m n o p q"]
    whole = [render_prompt(role.tokenizer, t, cfg.data.chat_template) for t in texts]
    assert len(whole[1]) <= 6 < min(len(whole[0]), len(whole[2]))
    with caplog.at_level(logging.WARNING, logger="toolkit.roles.generator"):
        tokens = role._tokenize(3, texts)
        assert tokens == [whole[0][-6:], whole[1], whole[2][-6:]]  # (the end of a prompt is what it asks)
        role._tokenize(4, texts)
    longest = max(len(whole[0]), len(whole[2]))
    assert [r.getMessage() for r in caplog.records] == [
        f"step {s}: 2 of 3 prompt(s) cut from the left to rollout.max_prompt_tokens 6 (the longest had {longest} "
        f"tokens; {n} cut so far)" for s, n in ((3, 2), (4, 4))]
    caplog.clear()
    assert role._tokenize(5, ["hi"]) == [whole[1]] and not caplog.records  # nothing cut, nothing said


def test_a_long_prompt_keeps_its_bos_token_first(tiny, tmp_path):
    """A prompt that starts with BOS (the tiny chat template writes it, as Llama-3's and Gemma's do) lost it
    when cut from the left: the model sampled from a sequence without the token it always saw first."""
    cfg = load_config(write_config(tmp_path, example("tiny-grpo.yaml", tiny, rollout={"max_prompt_tokens": 6})))
    role = GeneratorRole(SimpleNamespace(cfg=cfg, status={}))
    role.tokenizer, role.truncated = AutoTokenizer.from_pretrained(cfg.tokenizer_path), 0
    bos = role.tokenizer.bos_token_id
    messages = [{"role": "user", "content": "the river runs past the mill and on to the sea"}]
    whole = render_prompt(role.tokenizer, messages, False)
    assert whole[0] == bos and len(whole) > 6
    assert role._tokenize(0, [messages]) == [[bos] + whole[-5:]]
    assert role.tokenizer.decode(role._tokenize(0, [messages])[0]).startswith("<s>")
