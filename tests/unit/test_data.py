"""Data as users have it: the three readers give the same rows; rows become each stage's examples; one
seeded split gives the stages disjoint parts; sources blend by weight; the RL feeder resumes; bad rows
and files are named by file and line (or row) with the fix."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.conftest import with_bos
from toolkit.config.data import DataSection
from toolkit.data.dataset import StageData
from toolkit.data.prompts import PromptFeeder, prompt_text
from toolkit.data.sources import read_source
from toolkit.data.tokens import fit, render_prompt, response_ids
from toolkit.errors import ConfigError
from toolkit.use.generate import read_rows


def jsonl(path: Path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def parquet(path: Path, rows) -> str:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(columns(rows)), path)
    return str(path)


def saved(path: Path, rows) -> str:
    import datasets

    datasets.Dataset.from_list(columns(rows)).save_to_disk(str(path))
    return str(path)


def columns(rows: list[dict]) -> list[dict]:
    """Every row with every field of the rows, None where it has none, as a table has them (pyarrow's
    `from_pylist` and `datasets` would take the first row's fields as the columns)."""
    keys = list(dict.fromkeys(k for r in rows for k in r))
    return [{k: r.get(k) for k in keys} for r in rows]


def data(**fields) -> DataSection:
    return DataSection.model_validate(fields)


ROWS = [{"prompt": f"q{i}", "response": f"a{i}", "chosen": f"good {i}", "rejected": f"bad {i}", "n": i}
        for i in range(40)]


def test_three_formats_read_the_same_rows(tmp_path):
    paths = [jsonl(tmp_path / "d.jsonl", ROWS), parquet(tmp_path / "d.parquet", ROWS), saved(tmp_path / "d", ROWS)]
    read = [read_source(p) for p in paths]
    assert [r.data for r in read[0]] == [r.data for r in read[1]] == [r.data for r in read[2]] == ROWS
    assert read[0][3].location == f"{paths[0]}:4" and read[1][3].location == f"{paths[1]}: row 4"
    assert read[2][3].location == f"{paths[2]}: row 4"
    for path in paths:  # each stage's kind of example from every format
        sft = StageData(data(sources=[{"path": path}]), "sft", "sft", 0).train[0]
        pairs = StageData(data(sources=[{"path": path}]), "rm", "pair", 0).train[0]
        assert {(e.prompt, e.response) for e in sft} == {(r["prompt"], r["response"]) for r in ROWS}
        assert {(e.chosen, e.rejected) for e in pairs} == {(r["chosen"], r["rejected"]) for r in ROWS}
    # `prompts: FILE` takes a Parquet file by its name too (it was read as JSON Lines: "not UTF-8")
    rl = StageData(data(prompts=paths[1]), "rl", "prompt", 0).train[0]
    assert sorted(e.prompt for e in rl) == sorted(r["prompt"] for r in ROWS)


def test_split_is_disjoint_decided_by_content_and_has_eval_parts(tmp_path):
    rows = [{"prompt": f"p{i}", "response": "r", "chosen": "c", "rejected": "x"} for i in range(3000)]
    path = jsonl(tmp_path / "d.jsonl", rows)
    section = data(sources=[{"path": path}], split={"sft": 2, "rm": 4, "rl": 4, "seed": 7}, eval_fraction=0.1)
    parts = {stage: StageData(section, stage, kind, 0) for stage, kind in (("sft", "sft"), ("rm", "pair"),
                                                                           ("rl", "prompt"))}
    ids = {stage: {e.id for e in d.train[0]} | {e.id for e in d.eval} for stage, d in parts.items()}
    assert not ids["sft"] & ids["rm"] and not ids["sft"] & ids["rl"] and not ids["rm"] & ids["rl"]
    assert set().union(*ids.values()) == set(range(3000))  # every row in exactly one part
    for stage, share in (("sft", 0.2), ("rm", 0.4), ("rl", 0.4)):
        assert abs(len(ids[stage]) / 3000 - share) < 0.03, (stage, len(ids[stage]))
        d = parts[stage]
        assert abs(len(d.eval) / len(ids[stage]) - 0.1) < 0.03 and not {e.id for e in d.eval} & {e.id for e in d.train[0]}
    # decided by each row's content, not its position: the same rows shuffled land in the same parts
    reordered = jsonl(tmp_path / "r.jsonl", rows[::-1])
    again = StageData(data(sources=[{"path": reordered}], split={"sft": 2, "rm": 4, "rl": 4, "seed": 7},
                           eval_fraction=0.1), "sft", "sft", 0)
    assert {e.prompt for e in again.train[0]} == {e.prompt for e in parts["sft"].train[0]}
    # another seed, another split
    other = StageData(data(sources=[{"path": path}], split={"sft": 2, "rm": 4, "rl": 4, "seed": 8}), "sft", "sft", 0)
    assert {e.prompt for e in other.train[0]} != {e.prompt for e in parts["sft"].train[0]}


def test_every_row_of_a_prompt_goes_to_one_part_and_a_held_out_prompt_to_no_training(tmp_path):
    """Several rows per prompt (responses, pairs, or a prompt file with repeats): the split and the held-out
    share are decided by the prompt, so no prompt of RL's held-out rows is trained on by any stage (hashing
    the whole row put the same prompt in every part and in training beside its held-out rows)."""
    rows = [{"prompt": f"p{i % 100}", "response": f"r{i}", "chosen": f"c{i}", "rejected": f"x{i}"} for i in range(3000)]
    path = jsonl(tmp_path / "d.jsonl", rows)
    section = data(sources=[{"path": path}], split={"sft": 2, "rm": 4, "rl": 4, "seed": 7}, eval_fraction=0.2)
    parts = {stage: StageData(section, stage, kind, 0) for stage, kind in (("sft", "sft"), ("rm", "pair"),
                                                                           ("rl", "prompt"))}
    prompts = {stage: {e.prompt for e in d.train[0]} for stage, d in parts.items()}
    held = {e.prompt for e in parts["rl"].eval}
    assert held and not held & set().union(*prompts.values())
    assert not (prompts["sft"] & prompts["rm"] or prompts["sft"] & prompts["rl"] or prompts["rm"] & prompts["rl"])
    assert sum(len(d.train[0]) + len(d.eval) for d in parts.values()) == 3000  # (every row in one part)


def test_a_source_that_names_its_part_goes_to_that_stage_whole(tmp_path):
    """data.sources[].part: every row of the source is that stage's, whatever data.split gives; another
    stage's own source is left out (its rows keep their ids); a stage with no source of its own is named."""
    shared = jsonl(tmp_path / "shared.jsonl", ROWS)
    prompts = jsonl(tmp_path / "prompts.jsonl", [{"prompt": f"mine {i}"} for i in range(50)])
    section = data(sources=[{"path": shared}, {"path": prompts, "part": "rl"}], split={"sft": 1, "rm": 1, "rl": 1})
    rl = StageData(section, "rl", "prompt", 0)
    mine = [e for e in rl.train[1]]
    assert len(mine) == 50 and {e.id for e in mine} == set(range(40, 90))
    assert 0 < len(rl.train[0]) < 40  # (the shared rows: split)
    sft = StageData(section, "sft", "sft", 0)
    assert len(sft.train) == 1 and not any(e.prompt.startswith("mine") for e in sft.next(200))
    alone = data(sources=[{"path": prompts, "part": "rl"}], split={"sft": 1, "rl": 1})
    with pytest.raises(ConfigError, match="every source is another stage's .data.sources...part., none the sft"):
        StageData(alone, "sft", "sft", 0)


def test_a_prompt_rows_fields_reach_the_reward_functions_as_plain_values_or_are_named(tiny, tmp_path):
    """Fields go to the scorers in msgpack: a Parquet timestamp or decimal column (as real data sets have)
    and a JSON id beyond 64 bits failed the run at its first step, after start-up, with `TypeError: can not
    serialize 'datetime.datetime' object` or `OverflowError: Integer value out of range`, naming no row."""
    import datetime
    import decimal

    from tests.conftest import cli, example, write_config
    from toolkit.data.examples import check_fields

    stamp = datetime.datetime(2025, 1, 2, 3, 4, 5)
    rows = [{"prompt": f"q{i}", "at": stamp, "price": decimal.Decimal("1.50"), "day": stamp.date(),
             "tags": [{"since": stamp}]} for i in range(4)]
    rl = StageData(data(sources=[{"path": parquet(tmp_path / "d.parquet", rows)}]), "rl", "prompt", 0)
    fields = rl.train[0][0].fields
    assert fields == {"at": "2025-01-02T03:04:05", "price": "1.50", "day": "2025-01-02",
                      "tags": [{"since": "2025-01-02T03:04:05"}]}, fields
    check_fields(rl.train[0])  # (they travel)
    big = jsonl(tmp_path / "big.jsonl", [{"prompt": "q0", "uid": 1}, {"prompt": "q1", "uid": 10 ** 30}])
    with pytest.raises(ConfigError, match=re.escape(f"{big}:2: field 'uid' (1000000000000000000000000000000) cannot "
                                                     "be sent to the reward functions (OverflowError")):
        check_fields(StageData(data(sources=[{"path": big}], shuffle=False), "rl", "prompt", 0).train[0])
    result = cli("validate", write_config(tmp_path, example("tiny-grpo.yaml", tiny, data={"prompts": big})))
    assert result.returncode == 2 and f"{big}:2: field 'uid'" in result.stderr, result.stderr


def test_blend_follows_the_weights(tmp_path):
    small = jsonl(tmp_path / "small.jsonl", [{"prompt": f"s{i}"} for i in range(10)])
    large = parquet(tmp_path / "large.parquet", [{"prompt": f"l{i}"} for i in range(500)])
    d = StageData(data(sources=[{"path": small, "weight": 3}, {"path": large, "weight": 1}]), "rl", "prompt", 5)
    drawn = d.next(4000)
    share = sum(e.prompt.startswith("s") for e in drawn) / len(drawn)
    assert abs(share - 0.75) < 0.03, share  # by weight, not by size (the small source repeats)
    assert {e.id for e in drawn if e.prompt.startswith("l")} <= set(range(10, 510))  # ids after the first source
    again = StageData(data(sources=[{"path": small, "weight": 3}, {"path": large, "weight": 1}]), "rl", "prompt", 5)
    again.skip(1234)
    assert [e.id for e in again.next(50)] == [e.id for e in drawn[1234:1284]]  # any cursor resumes


def test_a_resume_skips_a_long_run_s_draws_at_once():
    """A resume skips the draws of the steps before it: drawing every row took 46 s after 10M draws (10,000
    steps of 1,000 prompts, one source of 1M rows). The cursor is the one `next` leaves, at the turn of a
    pass too, for one source and for several."""
    import time

    from toolkit.data.blend import Blend

    for sizes, weights in (([5], [1.0]), ([7, 3, 11], [3.0, 1.0, 2.0])):
        drawn = Blend(sizes, weights, True, 3).next(300)
        for cursor in [*range(45), 99, 100, 233]:
            again = Blend(sizes, weights, True, 3)
            again.next(17)  # (a feeder that drew already skips from the start as well)
            again.skip(cursor)
            assert again.next(60) == drawn[cursor:cursor + 60], (sizes, cursor)
    started = time.monotonic()
    Blend([1000], [1.0], True, 0).skip(10_000_000)
    Blend([1000, 10], [1.0, 1.0], True, 0).skip(500_000)
    assert time.monotonic() - started < 3.0, time.monotonic() - started

def test_a_run_reads_its_data_once_where_it_checked_it(tmp_path):
    """`run` read the data to check it, then its driver again for the prompt feeder and again for the held-out
    prompts: 29 s, 28 s and 47 s for a prompt file of 1M rows here. The driver now takes the examples the check
    made (with a cursor of its own); a file changed since is read again."""
    import time

    from toolkit.data.prompts import read_prompts

    path = tmp_path / "p.jsonl"
    jsonl(path, [{"prompt": f"Write about item {i}:", "topic": str(i % 7)} for i in range(30000)])
    section = data(sources=[{"path": str(path)}], eval_fraction=0.1)
    started = time.monotonic()
    checked = StageData(section, "rl", "prompt", 4)  # (what check_data builds)
    read_s = time.monotonic() - started
    started = time.monotonic()
    feeder = PromptFeeder(read_prompts(section, 4))
    held = StageData(section, "rl", "prompt", 4).eval  # (what heldout_prompts reads)
    again_s = time.monotonic() - started
    assert feeder.data.train[0][0] is checked.train[0][0] and held[0] is checked.eval[0]
    assert again_s < read_s / 5, (again_s, read_s)
    first = [e.id for e in checked.next(40)]
    assert [e.id for e in feeder.next(40)] == first  # (a cursor of its own: from the start)
    path.write_text(path.read_text().replace("Write about item 0:", "Write about item X:"))  # (the same size)
    changed = StageData(section, "rl", "prompt", 4)
    assert changed.train_rows + len(changed.eval) == 30000
    assert "Write about item X:" in {e.prompt for part in [*changed.train, changed.eval] for e in part}

def test_prompt_feeder_order_epochs_and_resume(tmp_path):
    path = jsonl(tmp_path / "p.jsonl", [{"q": str(i), "answer": i} for i in range(5)])
    section = data(sources=[{"path": path}], prompt_key="q")
    feeder = PromptFeeder(StageData(section, "rl", "prompt", 3))
    first = feeder.next(7)
    assert sorted(p.id for p in first[:5]) == list(range(5))  # a whole pass, then the next one
    assert first[0].fields == {"answer": int(first[0].prompt)}
    rest = [p.id for p in feeder.next(6)]
    again = PromptFeeder(StageData(section, "rl", "prompt", 3))
    again.skip(7)
    assert [p.id for p in again.next(6)] == rest
    plain = PromptFeeder(StageData(data(sources=[{"path": path}], prompt_key="q", shuffle=False), "rl", "prompt", 3))
    assert [p.id for p in plain.next(6)] == [0, 1, 2, 3, 4, 0]


def test_chat_rows_render_with_the_chat_template(tiny, tmp_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny / "model")
    conversation = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"},
                    {"role": "assistant", "content": "hello 42"}]
    section = data(sources=[{"path": jsonl(tmp_path / "chat.jsonl", [{"messages": conversation}])}])
    sft = StageData(section, "sft", "sft", 0).train[0]
    ex = next(e for e in sft if isinstance(e.prompt, list) and len(e.prompt) == 2)
    assert ex.response == "hello 42" and ex.prompt == conversation[:2]
    text = tokenizer.decode(render_prompt(tokenizer, ex.prompt, False))
    assert text == "<s>system: be brief\n<s>user: hi there\n<s>assistant: "
    # a text prompt, rendered as a user message when data.chat_template asks
    assert tokenizer.decode(render_prompt(tokenizer, "hi there", True)) == "<s>user: hi there\n<s>assistant: "
    assert tokenizer.decode(render_prompt(tokenizer, "hi there", False)) == "hi there"
    assert response_ids(tokenizer, "hello 42")[-1] == tokenizer.eos_token_id
    pairs = jsonl(tmp_path / "pairs.jsonl", [{"prompt": [{"role": "user", "content": "hi there"}],
                                               "chosen": conversation[-1:], "rejected": "no"},
                                              {"chosen": conversation[1:], "rejected": conversation[1:2] + [
                                                  {"role": "assistant", "content": "nope"}]}])
    pair = StageData(data(sources=[{"path": pairs}]), "rm", "pair", 0).train[0]
    assert sorted((e.chosen, e.rejected) for e in pair) == [("hello 42", "no"), ("hello 42", "nope")]
    assert all(e.prompt == [{"role": "user", "content": "hi there"}] for e in pair)  # from the conversation too
    assert prompt_text(conversation[:2]) == "hi there"  # what a rule-based reward reads


def test_a_response_that_ends_with_the_end_of_sequence_text_gets_one_end_of_sequence_token(tiny):
    """Data written for trainers that do not add it ("...</s>"): SFT trained a second </s> after the first as a
    target, and a reward model read its reward at that second one, where a generated response has one."""
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    from toolkit.data.examples import Example
    from toolkit.training.sft import SFTTask

    tokenizer = AutoTokenizer.from_pretrained(tiny / "model")
    eos = tokenizer.eos_token_id
    assert response_ids(tokenizer, "hello 42</s>") == response_ids(tokenizer, "hello 42")
    assert response_ids(tokenizer, "hello 42").count(eos) == 1
    task = SFTTask(SimpleNamespace(data=SimpleNamespace(chat_template=False), train=SimpleNamespace(max_tokens=64)),
                   tokenizer)
    batch = task.batch([Example(0, "x:1", prompt=[{"role": "user", "content": "hi"}], response="hello 42</s>")])
    trained = batch["input_ids"][0][batch["loss_mask"][0].bool()]
    assert tokenizer.decode(trained) == "hello 42</s>" and batch["targets"] == len(trained)


def test_a_response_written_by_a_chat_template_ends_with_its_end_token_once(tiny):
    """Pairs written with a chat template end each response with the turn's end token and the newline the template
    writes after it (Qwen's "...<|im_end|>\\n", Gemma's "...<end_of_turn>\\n"): the end-of-sequence token was added
    after the newline, so a reward model was trained at "<|im_end|>\\n<|im_end|>", where in RL the generator stops
    at the first <|im_end|> and the scorer reads it there; SFT trained the newline and a second end as targets."""
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    from toolkit.training.rm import RMTask

    tokenizer = AutoTokenizer.from_pretrained(tiny / "model")
    eos, generated = tokenizer.eos_token_id, response_ids(tokenizer, "hello 42")  # (as the generator ends it)
    for written in ("hello 42</s>\n", "hello 42</s>", "hello 42</s>\n</s>\n\n"):
        assert response_ids(tokenizer, written) == generated, written
    assert generated.count(eos) == 1 and generated[-1] == eos
    # whitespace before the end is the response's own
    assert response_ids(tokenizer, "hello 42\n</s>\n") == response_ids(tokenizer, "hello 42\n") != generated
    cfg = SimpleNamespace(data=SimpleNamespace(chat_template=False), train=SimpleNamespace(max_tokens=64))
    assert RMTask(cfg, tokenizer).sequence("hi there", "hello 42</s>\n")[-len(generated):] == generated


def test_a_text_prompt_rendered_with_the_chat_template_already_has_one_bos_token(tiny, tmp_path):
    """A tokenizer that adds BOS to text and a prompt column written with the template (which writes BOS
    itself): the prompt started with two BOS tokens in SFT, RM and RL."""
    tokenizer = with_bos(tiny / "model", tmp_path / "bos")
    bos = tokenizer.bos_token_id
    messages = [{"role": "user", "content": "hi there"}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered.startswith("<s>")
    assert render_prompt(tokenizer, rendered, False) == render_prompt(tokenizer, messages, False)
    assert render_prompt(tokenizer, rendered, False).count(bos) == rendered.count("<s>")
    assert render_prompt(tokenizer, "hi there", False).count(bos) == 1  # (text without it takes the tokenizer's)


def test_ptx_text_rows_start_with_the_bos_token_a_text_prompt_has(tiny, tmp_path):
    """PTX text was tokenized as a response (no BOS) where the RL prompts, and pretraining, start with one."""
    from toolkit.config.schema import PtxSection
    from toolkit.training.ptx import PtxText

    tokenizer = with_bos(tiny / "model", tmp_path / "bos")
    rows = jsonl(tmp_path / "text.jsonl", [{"text": "the rivers run"}, {"text": "stars and maps</s>"}])
    ptx = PtxSection.model_validate({"coef": 1.0, "max_tokens": 64, "data": {"sources": [{"path": rows}]}})
    ids, attention, _ = PtxText(ptx, tokenizer, 0, 2, 1, 0, 1).batch(0, 0)
    texts = sorted(tokenizer.decode(row[mask.bool()]) for row, mask in zip(ids, attention))
    assert texts == ["<s>stars and maps</s>", "<s>the rivers run</s>"]


def test_fit_cuts_the_prompt_from_the_left():
    assert fit([1, 2, 3, 4], [5, 6], 4) == ([3, 4], [5, 6])
    assert fit([1, 2], [5, 6, 7, 8, 9], 3, keep="end") == ([], [7, 8, 9])  # a reward model reads the end
    assert fit([1, 2], [5, 6, 7, 8, 9], 3, keep="start") == ([], [5, 6, 7])
    assert fit([1], [2], 5) == ([1], [2])
    # a BOS token (1 here) stays first where there is room for it and a token after it
    assert fit([1, 2, 3, 4], [5, 6], 4, bos=1) == ([1, 4], [5, 6])
    assert fit([1, 2, 3, 4], [5, 6], 3, bos=1) == ([4], [5, 6])
    assert fit([7, 2, 3, 4], [5, 6], 4, bos=1) == ([3, 4], [5, 6])


@pytest.mark.parametrize("text,kind,expected", [
    ('{"prompt": "a"}\n[1, 2]\n', "prompt", ":2: expected a JSON object"),
    ('{"prompt": "a"}\n{"prompt": "b"\n', "prompt", ":2: not valid JSON (Expecting ',' delimiter at column 15)"),
    ('{"prompt": ""}\n', "prompt", ":1: field 'prompt' is '' (str), not non-empty text"),
    ('{"prompt": "a"}\n{"prompt": 3}\n', "prompt", ":2: field 'prompt' is 3 (int), not non-empty text"),
    ('{"question": "a"}\n', "prompt", "set data.prompt_key to the field holding the prompt"),
    ('{"prompt": "a", "chosen": "b"}\n', "pair", ":1: field 'rejected' (the other response) is missing"),
    ('{"prompt": "a"}\n', "sft", ":1: no response: expected a field 'response', 'chosen' or 'messages'"),
    ('{"messages": [{"role": "user"}]}\n', "sft", ":1: messages[0] is not a message"),
    ('{"prompt": "a", "response": [{"role": "user", "content": "x"}]}\n', "sft", "must be the assistant's message"),
    ("\n\n", "prompt", "no rows in the file"),
    # an empty or blank response, two same responses, a blank prompt: refused in every form the rows come in
    ('{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": ""}]}\n', "sft",
     ":1: messages: the assistant's last message (the response) is empty"),
    ('{"prompt": "q", "chosen": [{"role": "assistant", "content": " "}], "rejected": "b"}\n', "pair",
     ":1: chosen: the assistant's last message (the preferred response) is empty"),
    ('{"prompt": "q", "response": "  "}\n', "sft", ":1: field 'response' (the response) is missing or not a non-empty"),
    ('{"prompt": "q", "chosen": "a", "rejected": "a"}\n', "pair",
     ":1: 'chosen' and 'rejected' are the same response ('a'); a pair needs two different responses"),
    ('{"prompt": " \\n"}\n', "prompt", ":1: field 'prompt' is ' \\n' (str), not non-empty text"),
    # whole conversations whose earlier turns differ: the rejected reply was paired with the chosen one's prompt
    ('{"chosen": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}], "rejected": '
     '[{"role": "user", "content": "a joke?"}, {"role": "assistant", "content": "no"}]}\n', "pair",
     ":1: 'chosen' and 'rejected' are conversations whose turns before the last message differ (from message 0"),
    # roles a chat template may not know (Qwen's drops such a message from the prompt without a word)
    ('{"prompt": [{"role": "human", "content": "q"}]}\n', "prompt",
     ":1: prompt[0] has role 'human'; chat templates know 'user'"),
    ('{"messages": [{"role": "user", "content": "q"}, {"role": "Assistant", "content": "a"}]}\n', "sft",
     ":1: messages[1] has role 'Assistant'; chat templates know 'assistant'"),
    # half of an emoji (a lone surrogate escape): JSON reads it, UTF-8 cannot hold it (a UnicodeEncodeError in
    # the split's hash); an escaped pair is one character
    ('{"prompt": "a \\ud83d\\ude00"}\n{"prompt": "cut \\ud83d"}\n', "prompt",
     ":2: field 'prompt' holds a lone surrogate ('\\ud83d' at character 5"),
    ('{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "\\udc00"}]}\n', "sft",
     ":1: field 'messages[1].content' holds a lone surrogate"),
])
def test_bad_rows_are_named_by_file_and_line(tmp_path, text, kind, expected):
    path = tmp_path / "p.jsonl"
    path.write_text(text)
    with pytest.raises(ConfigError, match=re.escape(expected)) as info:
        StageData(data(sources=[{"path": str(path)}]), "x", kind, 0)
    assert str(path) in str(info.value)


def test_jsonl_is_utf8_with_or_without_a_byte_order_mark(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"prompt": "caf\xc3\xa9"}\n{"prompt": "b"}\n')  # (as some Windows editors save)
    assert [(r.location, r.data["prompt"]) for r in read_source(str(path))] == [(f"{path}:1", "caf\u00e9"),
                                                                              (f"{path}:2", "b")]
    path.write_bytes(b'{"prompt": "a"}\n{"prompt": "caf\xe9"}\n')  # Latin-1: a named error, not a traceback
    with pytest.raises(ConfigError, match=re.escape(f"{path}:2: not UTF-8 (byte 0xe9 at column 16)")):
        read_source(str(path))


def test_a_json_file_may_hold_one_array_of_objects(tmp_path):
    """Alpaca-style data: one JSON array, pretty-printed or on one line; rows are named by their item."""
    path = tmp_path / "alpaca.json"
    path.write_text('[\n  {"prompt": "a", "response": "x"},\n  {"prompt": "b", "response": "y"}\n]\n')
    assert [(r.index, r.location, r.data["prompt"]) for r in read_source(str(path))] == [
        (0, f"{path}: item 1", "a"), (1, f"{path}: item 2", "b")]
    section = data(sources=[{"path": str(path)}])
    assert sorted(e.response for e in StageData(section, "sft", "sft", 0).train[0]) == ["x", "y"]
    for text, expected in [('[{"prompt": "a"},\n 3]', f"{path}: item 2 of the array: expected a JSON object"),
                           ('[{"prompt": "a"},\n {"prompt": "b",}]', f"{path}:2: not valid JSON"),
                           ('[{"prompt": "a"}]\n{"prompt": "b"}\n', f"{path}:2: not valid JSON (Extra data"),
                           ('[{"prompt": "a"},\n {"prompt": "b \\udc00"}]', f"{path}: item 2: field 'prompt' holds a "
                                                                            "lone surrogate")]:
        path.write_text(text)
        with pytest.raises(ConfigError, match=re.escape(expected)):
            read_source(str(path))


def test_alpaca_rows_join_the_input_to_the_instruction(tmp_path):
    """Alpaca's {instruction, input, output}: with input_key the input follows the instruction after a blank
    line where it is not empty; without it (the default) prompts are the instruction alone."""
    rows = [{"instruction": "Add the numbers.", "input": "2 and 3", "output": "5"},
            {"instruction": "Name a colour.", "input": "", "output": "Red"}]
    path = tmp_path / "alpaca.json"
    path.write_text(json.dumps(rows, indent=2))
    keys = {"sources": [{"path": str(path)}], "prompt_key": "instruction", "response_key": "output"}
    sft = StageData(data(**keys, input_key="input"), "sft", "sft", 0).train[0]
    assert sorted((e.prompt, e.response) for e in sft) == [("Add the numbers.\n\n2 and 3", "5"),
                                                          ("Name a colour.", "Red")]
    rl = StageData(data(**keys, input_key="input"), "rl", "prompt", 0).train[0]
    assert sorted(e.prompt for e in rl) == ["Add the numbers.\n\n2 and 3", "Name a colour."]
    assert sorted(e.prompt for e in StageData(data(**keys), "sft", "sft", 0).train[0]) == [
        "Add the numbers.", "Name a colour."]
    path.write_text(json.dumps([{**rows[0], "input": ["2", "3"]}]))
    with pytest.raises(ConfigError, match=re.escape(f"{path}: item 1: field 'input' (data.input_key) is list, "
                                                    "not text")):
        StageData(data(**keys, input_key="input"), "sft", "sft", 0)
    with pytest.raises(ValueError, match="input_key is the prompt's own field"):
        data(**keys, input_key="instruction")
    # an input beside a prompt of chat messages is not dropped without a word, in training and in `generate`
    chat = [{"role": "user", "content": "Add the numbers."}]
    path.write_text(json.dumps([{**rows[0], "instruction": chat}, {**rows[1], "instruction": chat}]))
    with pytest.raises(ConfigError, match=re.escape(f"{path}: item 1: field 'input' (data.input_key) is joined to "
                                                    "text prompts only, and this row's prompt is chat messages")):
        StageData(data(**keys, input_key="input"), "sft", "sft", 0)
    lines = tmp_path / "chat.jsonl"
    lines.write_text(json.dumps({"prompt": chat, "input": "2 and 3"}) + "\n")
    with pytest.raises(ConfigError, match=re.escape(f"{lines}:1: field 'input' (--input-key) is joined to text")):
        read_rows(str(lines), input_key="input")
    assert read_rows(str(lines))[0][2] == chat  # (without --input-key the field is just a field)


def test_hh_rows_take_the_text_both_responses_share_as_the_prompt(tmp_path):
    """Anthropic's HH-RLHF rows, {chosen, rejected} as whole texts: the prompt is their shared text up to its last
    "\\n\\nAssistant:" (text without that marker: up to its last whitespace, which starts each response); RM
    pairs, SFT (the chosen one) and RL prompts read it so."""
    two_turns = "\n\nHuman: Hi\n\nAssistant: Hello.\n\nHuman: And you?\n\nAssistant:"
    rows = [{"chosen": "\n\nHuman: Name a fruit.\n\nAssistant: An apple.",
             "rejected": "\n\nHuman: Name a fruit.\n\nAssistant: A carrot."},
            {"chosen": two_turns + " Hello there", "rejected": two_turns + " Go away"},
            {"chosen": "\n\nHuman: Tea?\n\nAssistant: I like tea", "rejected": "\n\nHuman: Tea?\n\nAssistant: I hate it"},
            {"chosen": "Q: Tea? A: I like tea", "rejected": "Q: Tea? A: I hate it"}]
    path = jsonl(tmp_path / "hh.jsonl", rows)
    section = data(sources=[{"path": path}], shuffle=False)
    pairs = sorted(StageData(section, "rm", "pair", 0).train[0], key=lambda e: e.location)
    assert [(e.prompt, e.chosen, e.rejected) for e in pairs] == [
        ("\n\nHuman: Name a fruit.\n\nAssistant:", " An apple.", " A carrot."),  # (the shared "A" is no word)
        (two_turns, " Hello there", " Go away"),  # (the last turn's marker: an earlier one is no reply)
        ("\n\nHuman: Tea?\n\nAssistant:", " I like tea", " I hate it"),  # (a word both start with is theirs)
        ("Q: Tea? A: I", " like tea", " hate it")]  # (no turn marker: the last whitespace they share)
    assert [e.prompt + e.chosen for e in pairs] == [r["chosen"] for r in rows]
    sft = sorted(StageData(section, "sft", "sft", 0).train[0], key=lambda e: e.location)
    assert [(e.prompt, e.response) for e in sft] == [(p.prompt, p.chosen) for p in pairs]
    rl = sorted(StageData(section, "rl", "prompt", 0).train[0], key=lambda e: e.location)
    assert [e.prompt for e in rl] == [p.prompt for p in pairs]
    for row, says in [({"chosen": "same text", "rejected": "same text"}, "are the same text"),
                      ({"chosen": "yes", "rejected": "no"}, "share no text before their responses"),
                      ({"chosen": "\n\nHuman: Hi\n\nAssistant:", "rejected": "\n\nHuman: Hi\n\nAssistant: Go away"},
                       "'chosen' has no response after the prompt the two texts share")]:
        with pytest.raises(ConfigError, match=re.escape(f"{tmp_path / 'bad.jsonl'}:1: ") + ".*" + says):
            StageData(data(sources=[{"path": jsonl(tmp_path / "bad.jsonl", [row])}]), "rm", "pair", 0)


def test_whole_conversations_as_chosen_and_rejected_serve_every_stage(tmp_path):
    """{chosen: [user, assistant], rejected: [user, assistant]} with no prompt field: the prompt is the chosen
    conversation before its reply, for RM pairs, SFT (the chosen reply) and RL prompts alike; sft and rl
    refused these rows, asking for a data.prompt_key they have no field for."""
    ask = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a fruit."}]
    rows = [{"chosen": ask + [{"role": "assistant", "content": "An apple."}],
             "rejected": ask + [{"role": "assistant", "content": "A carrot."}]}]
    section = data(sources=[{"path": jsonl(tmp_path / "conv.jsonl", rows)}])
    pair = StageData(section, "rm", "pair", 0).train[0][0]
    sft = StageData(section, "sft", "sft", 0).train[0][0]
    rl = StageData(section, "rl", "prompt", 0).train[0][0]
    assert (pair.prompt, pair.chosen, pair.rejected) == (ask, "An apple.", "A carrot.")
    assert (sft.prompt, sft.response) == (ask, "An apple.") and rl.prompt == ask


def test_a_null_in_a_column_is_a_field_the_row_does_not_have(tmp_path):
    """Parquet and `datasets` give every row every column, null where a row has no such field (as pandas and
    pyarrow write rows of different fields): those rows read as their JSON Lines do, where they were refused
    ('field 'messages' must be a non-empty list', 'field 'prompt' is None')."""
    prompts = [{"prompt": "a", "topic": "x"}, {"messages": [{"role": "user", "content": "b"}]}]
    answered = [{"prompt": "c", "response": "d"}, {"prompt": "e", "chosen": "f", "rejected": "g"}]
    for write, name in ((jsonl, "m.jsonl"), (parquet, "m.parquet"), (saved, "m")):
        rl, sft = (write(tmp_path / f"{kind}-{name}", rows) for kind, rows in (("rl", prompts), ("sft", answered)))
        assert [r.data for r in read_source(rl)] == prompts and [r.data for r in read_source(sft)] == answered
        assert [e.prompt for e in StageData(data(sources=[{"path": rl}], shuffle=False), "rl", "prompt", 0).train[0]] \
            == ["a", [{"role": "user", "content": "b"}]], name
        assert [(e.prompt, e.response) for e in StageData(data(sources=[{"path": sft}], shuffle=False), "sft", "sft",
                                                          0).train[0]] == [("c", "d"), ("e", "f")], name


def test_gzipped_json_files_are_read_as_they_come(tmp_path):
    """HH-RLHF comes as train.jsonl.gz: a .jsonl.gz (or .json.gz array) reads the same rows as the plain file;
    a cut-off gzip file is named."""
    import gzip

    plain = jsonl(tmp_path / "d.jsonl", ROWS[:5])
    packed = tmp_path / "d.jsonl.gz"
    packed.write_bytes(gzip.compress(Path(plain).read_bytes()))
    array = tmp_path / "a.json.gz"
    array.write_bytes(gzip.compress(json.dumps(ROWS[:5]).encode()))
    assert [r.data for r in read_source(str(packed))] == [r.data for r in read_source(str(array))] == ROWS[:5]
    assert read_source(str(packed))[1].location == f"{packed}:2"
    sft = StageData(data(sources=[{"path": str(packed)}]), "sft", "sft", 0).train[0]
    assert sorted(e.response for e in sft) == sorted(r["response"] for r in ROWS[:5])
    packed.write_bytes(packed.read_bytes()[:-12])
    with pytest.raises(ConfigError, match=re.escape(f"{packed}: not a whole gzip file")):
        read_source(str(packed))
    damaged = bytearray(gzip.compress(json.dumps(ROWS).encode()))
    damaged[10] ^= 0xFF  # (the first byte of the compressed data: zlib's own error, not gzip's)
    packed.write_bytes(bytes(damaged))
    with pytest.raises(ConfigError, match=re.escape(f"{packed}: not a whole gzip file (Error -3 while decompressing")):
        read_source(str(packed))


def test_bad_files_are_named(tmp_path):
    rows = [{"prompt": "a", "response": "b"}] * 3
    broken = tmp_path / "broken.parquet"
    broken.write_bytes(b"not parquet at all")
    with pytest.raises(ConfigError, match="broken.parquet: not a readable Parquet file"):
        read_source(str(broken))
    with pytest.raises(ConfigError, match="cannot tell the format from the name"):
        read_source(jsonl(tmp_path / "rows.txt", rows))
    assert len(read_source(jsonl(tmp_path / "rows.txt", rows), "jsonl")) == 3  # unless it is declared
    with pytest.raises(ConfigError, match="not a data set saved with datasets' save_to_disk"):
        (tmp_path / "empty").mkdir()
        read_source(str(tmp_path / "empty"))
    damaged = bytearray(Path(parquet(tmp_path / "d.parquet", [{"prompt": f"question {i} " * 5} for i in range(300)]))
                        .read_bytes())
    damaged[200:260] = bytes(b ^ 0x5A for b in damaged[200:260])  # (a data page: the footer still reads)
    (tmp_path / "d.parquet").write_bytes(bytes(damaged))
    with pytest.raises(ConfigError, match=re.escape(f"{tmp_path / 'd.parquet'}: rows 1 onwards cannot be read (")):
        read_source(str(tmp_path / "d.parquet"))
    bad_row = parquet(tmp_path / "rows.parquet", [{"prompt": "a", "response": "b"}, {"prompt": "c", "response": ""}])
    with pytest.raises(ConfigError, match=r"rows.parquet: row 2: field 'response' \(the response\) is missing"):
        StageData(data(sources=[{"path": bad_row}]), "sft", "sft", 0)
    import datasets

    datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(ConfigError, match="without a 'train' split .*point data.sources"):
        read_source(str(tmp_path / "dd"))
    assert len(read_source(str(tmp_path / "dd" / "test"))) == 3


def test_a_split_that_leaves_a_stage_nothing_is_named(tmp_path):
    path = jsonl(tmp_path / "few.jsonl", [{"prompt": "only one", "response": "r"}])
    section = data(sources=[{"path": path}], split={"sft": 1, "rm": 1000})
    with pytest.raises(ConfigError, match="none of its 1 rows is left for training the sft stage"):
        StageData(section, "sft", "sft", 0)


def test_a_fingerprint_finds_data_that_changed_and_reads_only_what_may_have():
    """resume's check (toolkit/data/fingerprint.py): edited, added and removed files of a file source and
    of a directory source; a file touched with the same bytes is the same data; a file whose size and
    time did not change is not read again."""
    import os
    import tempfile
    from types import SimpleNamespace

    from toolkit.data.fingerprint import changes, fingerprint

    with tempfile.TemporaryDirectory() as tmp:
        rows, shards = Path(tmp) / "rows.jsonl", Path(tmp) / "saved"
        rows.write_text('{"prompt": "a"}\n')
        shards.mkdir()
        (shards / "part-0.arrow").write_bytes(b"0" * 100)
        source = lambda path: SimpleNamespace(path=str(path))  # noqa: E731
        cfg = SimpleNamespace(data=SimpleNamespace(sources=[source(rows), source(shards)]), ptx=None)
        then = fingerprint(cfg)
        assert set(then) == {"data.sources.0.path", "data.sources.1.path"}
        assert changes(then, fingerprint(cfg, then)) == []
        os.utime(rows, ns=(1, 1))  # touched, the same bytes
        assert changes(then, fingerprint(cfg, then)) == []
        rows.write_text('{"prompt": "b"}\n')  # the same size, other bytes
        assert changes(then, fingerprint(cfg, then)) == [
            f"{rows} (data.sources.0.path): other contents (16 bytes then, 16 now)"]
        (shards / "part-1.arrow").write_bytes(b"1")
        (shards / "part-0.arrow").unlink()
        assert changes(then, fingerprint(cfg, then))[1:] == [
            f"{shards / 'part-0.arrow'} (data.sources.1.path): gone",
            f"{shards / 'part-1.arrow'} (data.sources.1.path): a new file"]
        # unchanged size and time: the recorded checksum is kept, not computed again
        now = fingerprint(cfg)
        now["data.sources.0.path"]["files"]["."][2] = "xxh3_128:recorded"
        assert fingerprint(cfg, now)["data.sources.0.path"]["files"]["."][2] == "xxh3_128:recorded"


def test_a_resume_refuses_another_field_for_the_prompts(tmp_path):
    """The split and the held-out rows go by a hash of each row's prompt: a resume after `data.prompt_key`
    (or the other fields a prompt is read from) was changed in config.yaml drew other rows than the run began
    with, and nothing said so; it is now a change of the draw settings, as a changed file is. A run on the
    default fields records none of them (runs from before it recorded none)."""
    from types import SimpleNamespace

    from toolkit.data.fingerprint import draw_changes, draw_settings

    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"question": "a", "prompt": "b"}) + "\n")

    def settings(**keys):
        data = DataSection(prompts=str(rows), eval_fraction=0.1, **keys)
        return draw_settings(SimpleNamespace(data=data, stage="rl", run=SimpleNamespace(seed=1),
                                             rollout=SimpleNamespace(prompts_per_step=4)))

    default = settings()
    assert not [key for key in default if key.endswith("_key")]
    assert draw_changes(default, settings()) == []
    assert draw_changes(default, settings(prompt_key="question")) == ["data.prompt_key: 'prompt' then, 'question' now"]
    assert draw_changes(settings(input_key="x"), settings(input_key="y")) == ["data.input_key: 'x' then, 'y' now"]


def test_a_resume_refuses_another_order_of_the_ptx_text(tmp_path):
    """The PTX text of step s is rows s x (the rows a step takes) on of the order its seed, shuffle and sources'
    weights give (training/ptx.py): a resume after ptx.data.shuffle was changed in config.yaml went on in
    another order (5 of the first resumed step's 64 rows trained on before, in a review's run), and nothing
    said so. A run that had no PTX, or recorded no PTX settings (from before), is not refused for them."""
    from types import SimpleNamespace

    from toolkit.config.schema import PtxSection
    from toolkit.data.fingerprint import draw_changes, draw_settings

    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"prompt": "a", "text": "b"}) + "\n")

    def settings(coef=1.0, group_size=4, epochs=1, **ptx_data):
        ptx = PtxSection.model_validate({"coef": coef, "data": {"sources": [{"path": str(rows)}], **ptx_data}})
        return draw_settings(SimpleNamespace(data=DataSection(prompts=str(rows)), stage="rl", ptx=ptx,
                                             run=SimpleNamespace(seed=1), algorithm=SimpleNamespace(epochs=epochs),
                                             rollout=SimpleNamespace(prompts_per_step=4, group_size=group_size)))

    assert draw_changes(settings(), settings()) == []
    assert draw_changes(settings(), settings(shuffle=False)) == ["ptx.data.shuffle: True then, False now"]
    # (a step takes a PTX row per sample trained on: another group size or number of epochs moved the slices)
    assert draw_changes(settings(), settings(group_size=8)) == draw_changes(settings(), settings(epochs=2)) == [
        "ptx rows per step (algorithm.epochs x rollout.prompts_per_step x rollout.group_size): 16 then, 32 now"]
    assert draw_changes(settings(coef=0.0), settings(shuffle=False)) == []  # (PTX on now: its files' fingerprint)
    before = {k: v for k, v in settings().items() if not k.startswith("ptx")}
    assert draw_changes(before, settings(shuffle=False, group_size=8)) == []
