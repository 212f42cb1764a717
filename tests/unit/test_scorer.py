"""The reward role on real (tiny) models, without processes: a reward model reads the end of the response
(a long prompt is cut from the left), components are weighted and the total clipped."""

from __future__ import annotations

import json
import re
import shutil
import signal
import threading
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tests.conftest import example, with_bos, write_config
from tests.unit.test_samples_and_modeling import batch as make_batch
from toolkit.config import load_config
from toolkit.data.dataset import check_data
from toolkit.errors import ConfigError
from toolkit.roles.scorer import RewardRole
from toolkit.tiny import build_tokenizer


def reward_role(cfg) -> RewardRole:
    group = SimpleNamespace(gpus_per_worker=0, roles=("reward",), models=("reward",), workers=1)
    worker = SimpleNamespace(cfg=cfg, status={}, group=group)
    role = RewardRole(worker)
    role.setup()
    return role


def test_a_long_prompt_loses_its_start_not_the_response(tiny, tmp_path):
    rm = tmp_path / "rm"
    shutil.copytree(tiny / "reward_model", rm)
    build_tokenizer(rm, seed=7)  # another vocabulary: the scorer tokenizes the texts itself
    cfg = load_config(write_config(tmp_path, example(
        "tiny-grpo.yaml", tiny, rollout={"max_prompt_tokens": 8, "max_new_tokens": 8},
        reward={"functions": [{"function": "toolkit.rewards.examples:digit_ratio"}], "clip": 0.75,
                "models": [{"path": str(rm), "weight": 0.5, "name": "rm"}]})))
    role = reward_role(cfg)
    assert not role.reward_models[0].same_vocab
    b = make_batch()
    long_prompt = " ".join(["apples and rivers"] * 30)
    b.prompts, b.responses = [long_prompt, "short"], ["the end 42", "9 9 9"]
    role.score(b)
    model, tokenizer = role.reward_models[0].model, role.reward_models[0].tokenizer
    response = tokenizer("the end 42", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    prompt = tokenizer(long_prompt)["input_ids"]
    kept = prompt[len(prompt) - (16 - len(response)):] + response  # 16 = max_prompt_tokens + max_new_tokens
    with torch.no_grad():
        expected = model(torch.tensor([kept]))[0, -1].item()
        right_cut = model(torch.tensor([(prompt + response)[:16]]))[0, -1].item()  # the old behaviour
    assert abs(b.rewards[0, 1] - expected) < 1e-5
    assert abs(expected - right_cut) > 1e-3  # (so the test tells the two apart)
    # the total: 1.0 x digit_ratio + 0.5 x rm, clipped to [-0.75, 0.75]
    total = b.rewards @ np.array([1.0, 0.5], np.float32)
    assert np.allclose(b.reward_total, np.clip(total, -0.75, 0.75))
    assert b.reward_names == ["digit_ratio", "rm"] and b.rewards[1, 0] == 1.0


def test_a_reward_model_of_its_own_vocabulary_keeps_the_bos_token_of_a_cut_prompt(tiny, tmp_path):
    """A reward model whose tokenizer adds BOS (Llama-3's, Gemma's, Mistral's) read a prompt cut to the
    context without it, as the generator's prompts once were: it now keeps the BOS token first."""
    rm = tmp_path / "rm"
    shutil.copytree(tiny / "reward_model", rm)
    build_tokenizer(rm, seed=7)  # another vocabulary, then BOS added to text
    with_bos(rm, rm)
    cfg = load_config(write_config(tmp_path, example(
        "tiny-grpo.yaml", tiny, rollout={"max_prompt_tokens": 8, "max_new_tokens": 8},
        reward={"models": [{"path": str(rm), "name": "rm"}]})))
    role = reward_role(cfg)
    b = make_batch()
    long_prompt = " ".join(["apples and rivers"] * 30)
    b.prompts, b.responses = [long_prompt, "short"], ["the end 42", "9 9 9"]
    role.score(b)
    model, tokenizer = role.reward_models[0].model, role.reward_models[0].tokenizer
    bos = tokenizer.bos_token_id
    response = tokenizer("the end 42", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    prompt = tokenizer(long_prompt)["input_ids"]
    room = 16 - len(response)  # (16 = max_prompt_tokens + max_new_tokens)
    assert prompt[0] == bos and len(prompt) > room
    with torch.no_grad():
        expected = model(torch.tensor([[bos] + prompt[len(prompt) - room + 1:] + response]))[0, -1].item()
        without = model(torch.tensor([prompt[len(prompt) - room:] + response]))[0, -1].item()  # (before)
    got = b.rewards[0, b.reward_names.index("rm")]
    assert abs(got - expected) < 1e-5 and abs(expected - without) > 1e-4, (got, expected, without)


def trl_style(completions, **kwargs):  # (TRL's convention: lists of samples)
    return [0.0] * len(completions)


def needs_answer(prompt, response, answer, **fields):
    return float(answer in response)


def no_fields(prompt, response):
    return 0.0


def test_a_reward_function_that_cannot_be_called_so_is_a_config_error(tiny, tmp_path):
    """The scorer calls function(prompt=..., response=..., **fields, **args) per sample; a function that
    cannot take that for the RL rows (their fields read from the data) is refused before any process starts,
    naming the function and a row (it failed at the first scoring)."""
    qa = tmp_path / "qa.jsonl"
    qa.write_text("".join(json.dumps({"prompt": f"{i}+{i}=", "answer": str(2 * i)}) + "\n" for i in range(8)))

    def config(name: str, args=None, prompts=None):
        data = example("tiny-grpo.yaml", tiny, reward={"functions": [
            {"function": "toolkit.rewards.examples:digit_ratio"},
            {"function": f"tests.unit.test_scorer:{name}", "args": args or {}}]})
        data["data"]["prompts"] = str(prompts or tiny / "prompts.jsonl")
        return load_config(write_config(tmp_path, data))

    topics = f"{tiny / 'prompts.jsonl'}:1 (prompt, response, topic)"
    for name, prompts, args, expected in [
        ("trl_style", None, None, f"reward.functions.1: tests.unit.test_scorer:trl_style(completions, **kwargs) "
                                  f"cannot be called with what the scorer gives it for {topics}: missing a required "
                                  "argument: 'completions'. A reward function scores one sample"),
        ("needs_answer", None, None, "missing a required argument: 'answer'"),
        ("no_fields", qa, None, f"for {qa}:1 (prompt, response, answer): got an unexpected keyword argument 'answer'"),
        ("needs_answer", qa, {"answer": "4"}, f"reward.functions.1.args: answer is given by the scorer too (the "
                                              f"prompt, the response, or a field of {qa}:1); rename it"),
    ]:
        with pytest.raises(ConfigError, match=re.escape(expected)):
            check_data(config(name, args, prompts))
    check_data(config("needs_answer", None, qa))  # (the rows have the field it needs)


def test_a_reward_is_a_finite_number_and_nothing_else():
    """float() read the text "0.5" as a reward, silently; None (a function without a return) and a list
    were named only by float's own TypeError. The error names the sample too (a group's samples share the
    prompt id)."""
    from toolkit.roles.scorer import RewardFunctionError

    b = make_batch()
    for given, expected in [(0.5, 0.5), (2, 2.0), (True, 1.0), (np.float32(0.25), 0.25), (torch.tensor(0.75), 0.75)]:
        out = RewardRole._call_function(("f", lambda **kw: given, {}, "m:f"), b)
        assert out.tolist() == [expected, expected], given
    for given in ("0.5", None, [1.0], float("inf"), 10**400, torch.ones(2)):
        with pytest.raises(RewardFunctionError, match=re.escape(f"reward function 'f' (m:f) returned {given!r} for "
                                                                "prompt id 10, sample 0; rewards must be finite")):
            RewardRole._call_function(("f", lambda **kw: given, {}, "m:f"), b)


def test_a_reward_function_that_hangs_without_a_timeout_is_named_where_the_run_times_out():
    """A function with no timeout_s that stalls (a judge's network call) held the scorer until
    transport.step_timeout_s, and the run's error said only `scorer:0: scoring step 1`. While a function runs,
    the worker's status (which its heartbeats carry to the driver) names it and the sample, and the driver's
    timeout lists it with the worker; once the function is done, it is gone."""
    from toolkit.launch.supervisor import Supervisor

    status, seen = {"phase": "scoring", "step": 0}, []

    def judge(prompt, response, **fields):
        seen.append(status.get("doing"))
        return 0.5

    assert RewardRole._call_function(("judge", judge, {}, "m:judge"), make_batch(), status).tolist() == [0.5, 0.5]
    assert seen == ["reward function 'judge' (m:judge) on prompt id 10, sample 0",
                    "reward function 'judge' (m:judge) on prompt id 11, sample 0"] and "doing" not in status
    status["doing"] = seen[1]  # (what the driver heard while the function hung)
    driver = SimpleNamespace(worker_ids=["scorer:0"], coordinator=SimpleNamespace(status={"scorer:0": status}),
                             run_dir=SimpleNamespace(log_file=lambda w: f"logs/{w}.log"))
    assert Supervisor._who_is_where(driver) == ("worker states:\n  scorer:0: scoring step 1, in reward function "
                                               "'judge' (m:judge) on prompt id 11, sample 0 (log: logs/scorer:0.log)")


def test_a_reward_call_past_its_timeout_fails_naming_the_function_and_the_next_call_gets_a_new_thread():
    """Each function runs in a thread of its own, waited for at most reward.functions[].timeout_s: a call that
    stalls fails with the function's name and the sample, its thread is left to it (a daemon, which does
    not hold the worker at exit), and a later call runs in a new thread. Values and exceptions, SystemExit
    included, come back as from a direct call."""
    from toolkit.rewards.bounded import BoundedCalls
    from toolkit.roles.scorer import RewardFunctionError

    released = threading.Event()

    def judge(prompt, response, **fields):
        released.wait(60)  # (a network call that does not answer, until the test lets it)
        return 0.5

    b = make_batch()
    calls = BoundedCalls(judge, 0.2)
    expected = "reward function 'judge' (m:judge) gave no reward for prompt id 10, sample 0: no result within 0.2 s"
    with pytest.raises(RewardFunctionError, match=re.escape(expected)):
        RewardRole._call_function(("judge", calls, {}, "m:judge"), b)
    stuck = [t for t in threading.enumerate() if t.name == "reward judge"]
    assert len(stuck) == 1 and stuck[0].daemon and stuck[0].is_alive()
    released.set()
    stuck[0].join(10)
    assert RewardRole._call_function(("judge", calls, {}, "m:judge"), b).tolist() == [0.5, 0.5]

    def failing(**kw):
        raise ValueError("bad row")

    def quitting(**kw):
        raise SystemExit("out of quota")

    with pytest.raises(ValueError, match="bad row"):
        BoundedCalls(failing, 30)()
    with pytest.raises(SystemExit, match="out of quota"):
        BoundedCalls(quitting, 30)()


def test_a_reward_function_without_a_timeout_is_called_in_the_main_thread():
    """Without timeout_s a function is called as it is, in the scorer's main thread: one that sets a signal
    handler (math_verify's own timeouts use SIGALRM) works there and fails in a thread of its own."""
    from toolkit.rewards.bounded import bounded

    def with_alarm(**kw):
        previous = signal.signal(signal.SIGALRM, signal.SIG_IGN)
        signal.signal(signal.SIGALRM, previous)
        return 1.0

    assert bounded(with_alarm, None) is with_alarm
    assert RewardRole._call_function(("f", bounded(with_alarm, None), {}, "m:f"), make_batch()).tolist() == [1.0, 1.0]
    with pytest.raises(ValueError, match="main thread"):
        bounded(with_alarm, 30)()


def test_eval_with_longer_responses_than_the_run_scores_the_whole_sequence(tiny, tmp_path):
    """`eval --max-new-tokens` above the run's rollout.max_new_tokens: the reward model read prompt + response
    cut to the run's max_prompt_tokens + max_new_tokens, so a longer response lost its prompt (two prompts
    with the same response got one score), then its own start."""
    from toolkit.use.evaluate import reward_scorer

    cfg = load_config(write_config(tmp_path, example(
        "tiny-grpo.yaml", tiny, rollout={"max_prompt_tokens": 8, "max_new_tokens": 8},
        reward={"models": [{"path": str(tiny / "reward_model"), "name": "rm"}]})))
    role = reward_scorer(cfg, max_new_tokens=30)
    assert role.reward_models[0].same_vocab
    prompts, response = ([5, 6, 7], [9, 10, 11]), list(range(20, 50))
    b = make_batch(prompts=prompts, responses=(response, response))
    b.finished[:] = False  # (cut at max_new_tokens: a finished one ends with a stop token)
    role.score(b)
    with torch.no_grad():
        expected = [role.reward_models[0].model(torch.tensor([p + response]))[0, -1].item() for p in prompts]
    assert np.allclose(b.rewards[:, 1], expected, atol=1e-5), (b.rewards[:, 1], expected)
    assert abs(expected[0] - expected[1]) > 1e-4  # (the prompts tell them apart)


def test_a_response_ended_by_an_end_of_turn_token_is_scored_at_the_eos_the_rm_stage_trained(tiny, tmp_path):
    """The generator stops at the tokenizer's EOS and at every eos_token_id of the actor's generation_config
    (Gemma-it's <end_of_turn> beside <eos>, Llama-3-Instruct's <|eot_id|> beside <|end_of_text|>); the `rm` stage
    trains the reward at the EOS token. A reward model of the actor's vocabulary read a response that stopped at
    <end_of_turn> there, at a token it was never trained to end at: the same text scored otherwise by its end."""
    from toolkit.training.rm import RMTask

    cfg = load_config(write_config(tmp_path, example(
        "tiny-grpo.yaml", tiny, reward={"models": [{"path": str(tiny / "reward_model"), "name": "rm"}]})))
    role = reward_role(cfg)
    rm = role.reward_models[0]
    assert rm.same_vocab
    eos, turn = rm.tokenizer.eos_token_id, 7  # (7: the end-of-turn token of a generation_config's eos list)
    trained = RMTask(SimpleNamespace(data=cfg.data, train=SimpleNamespace(max_tokens=64)), rm.tokenizer).sequence(
        "Write about apples:", "apples 42")
    prompt = rm.tokenizer("Write about apples:")["input_ids"]
    body = trained[len(prompt):-1]
    assert trained == prompt + body + [eos]
    b = make_batch(prompts=(prompt, prompt, prompt), responses=(body + [turn], body + [eos], body + [turn]),
                   group=(0, 0, 1))
    b.finished = np.array([True, True, False])  # (the last was cut at max_new_tokens after drawing token 7)
    role.score(b)
    with torch.no_grad():
        at_eos = rm.model(torch.tensor([trained]))[0, -1].item()
        at_turn = rm.model(torch.tensor([prompt + body + [turn]]))[0, -1].item()
    got = b.rewards[:, b.reward_names.index("rm")]
    assert abs(at_eos - at_turn) > 1e-4  # (the two ends tell the readings apart)
    assert np.allclose(got, [at_eos, at_eos, at_turn], atol=1e-5), (got, at_eos, at_turn)
