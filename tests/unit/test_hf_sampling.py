"""Where transformers sampling stops, and the seed each RL sample is drawn from."""

from __future__ import annotations

import json
import shutil

import torch

from toolkit.hf_sampling import sample, stop_ids
from toolkit.roles.generator import sample_seed


def test_a_response_stops_where_vllm_stops_it(tiny, tmp_path):
    """vLLM stops at the tokenizer's end-of-sequence token and at every eos_token_id of the model's own
    generation_config (Llama-3-Instruct's <|eot_id|>, Gemma-it's <end_of_turn>); transformers sampling
    stopped at the first only, and ran on past the end of a turn to max_new_tokens, unfinished."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny / "model", dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny / "model")
    free = sample(model, torch.device("cpu"), [[1, 5, 9]], [7], 1.0, 1.0, 12, 0, [])[0]
    turn = next(t for t in free.tokens[2:] if t != tokenizer.eos_token_id)  # (a token it draws, as an end of turn)
    at = free.tokens.index(turn)
    copy = tmp_path / "model"
    shutil.copytree(tiny / "model", copy)
    config = json.loads((copy / "generation_config.json").read_text())
    (copy / "generation_config.json").write_text(json.dumps({**config, "eos_token_id": [tokenizer.eos_token_id,
                                                                                       turn]}))
    model = AutoModelForCausalLM.from_pretrained(copy, dtype=torch.float32).eval()
    assert stop_ids(tokenizer, model) == [tokenizer.eos_token_id, turn]
    ended = sample(model, torch.device("cpu"), [[1, 5, 9]], [7], 1.0, 1.0, 12, 0, stop_ids(tokenizer, model))[0]
    assert ended.tokens == free.tokens[:at + 1] and ended.finished and len(ended.drawn) == at + 1
    assert sample(model, torch.device("cpu"), [[1, 5, 9]], [7], 1.0, 1.0, 12, 0, [])[0].tokens == free.tokens


def test_a_prompt_drawn_twice_in_a_step_gets_other_samples():
    """The seed was a hash of (run seed, step, prompt id, sample index): a prompt drawn twice in a step (a
    small source of a blend repeats) gave its two groups the same samples, one set trained on twice."""
    seeds = {(g, k): sample_seed(1, 3, 42, g, k) for g in (0, 5) for k in range(4)}
    assert len(set(seeds.values())) == 8
    assert sample_seed(1, 3, 42, 5, 2) == seeds[(5, 2)]  # (the same sample: one seed, wherever it is drawn)
