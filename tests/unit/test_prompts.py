"""Prompt feeder: ids are line numbers, order is a pure function of (seed, epoch), the cursor resumes."""

from __future__ import annotations

import json

import pytest

from toolkit.data.prompts import PromptFeeder, read_prompts
from toolkit.errors import ConfigError


def write(tmp_path, rows):
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_ids_and_fields(tmp_path):
    prompts = read_prompts(write(tmp_path, [{"prompt": "a", "answer": 1}, {"prompt": "b"}]), "prompt")
    assert [(p.id, p.text, p.fields) for p in prompts] == [(0, "a", {"answer": 1}), (1, "b", {})]


def test_order_epochs_and_resume(tmp_path):
    prompts = read_prompts(write(tmp_path, [{"q": str(i)} for i in range(5)]), "q")
    feeder = PromptFeeder(prompts, shuffle=True, seed=3)
    first = [p.id for p in feeder.next(7)]
    assert sorted(first[:5]) == list(range(5)) and feeder.epoch == 1  # a whole epoch, then the next one
    state = feeder.state_dict()
    rest = [p.id for p in feeder.next(6)]
    again = PromptFeeder(prompts, shuffle=True, seed=3)
    again.load_state_dict(state)
    assert [p.id for p in again.next(6)] == rest
    assert [p.id for p in PromptFeeder(prompts, shuffle=True, seed=3).next(7)] == first
    assert [p.id for p in PromptFeeder(prompts, shuffle=False, seed=3).next(6)] == [0, 1, 2, 3, 4, 0]


@pytest.mark.parametrize("text,expected", [
    ('{"prompt": "a"}\n[1, 2]\n', ":2: expected a JSON object"),
    ('{"prompt": ""}\n', ":1: no non-empty string field 'prompt'"),
    ("\n\n", "no prompts"),
])
def test_bad_files(tmp_path, text, expected):
    path = tmp_path / "p.jsonl"
    path.write_text(text)
    with pytest.raises(ConfigError, match=expected):
        read_prompts(str(path), "prompt")
