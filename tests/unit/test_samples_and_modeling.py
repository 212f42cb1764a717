"""SampleBatch (ragged samples over the wire) and the padded layout the scorer and trainer share."""

from __future__ import annotations

import numpy as np
import torch

from toolkit.modeling import gather_responses, pad_samples, scatter_responses, token_logprobs
from toolkit.samples import SampleBatch, ragged
from toolkit.transport.wire import Codec


def batch(step=0, prompts=([1, 2, 3], [4]), responses=([5, 6], [7, 8, 9]), group=(0, 1)):
    pt, po = ragged(list(prompts), np.int32)
    rt, ro = ragged(list(responses), np.int32)
    lp, _ = ragged([[-0.5 - i for i in range(len(r))] for r in responses], np.float32)
    n = len(prompts)
    return SampleBatch(step=step, prompt_ids=np.arange(n, dtype=np.int64) + 10, group_index=np.asarray(group, np.int32),
                       sample_index=np.zeros(n, np.int32), policy_version=np.full(n, 3, np.int32), prompt_tokens=pt,
                       prompt_offsets=po, response_tokens=rt, response_offsets=ro, behaviour_logprobs=lp,
                       finished=np.array([True, False][:n]), prompts=[f"p{i}" for i in range(n)],
                       responses=[f"r{i}" for i in range(n)], fields=[{"topic": "x"}] * n)


def test_message_round_trip():
    b = batch()
    b.ref_logprobs = np.array([-1, -2, -3, -4, -5], np.float32)
    b.rewards = np.array([[1.0, 0.5], [0.0, 2.0]], np.float32)
    b.reward_total = np.array([1.25, 1.0], np.float32)
    b.reward_names, b.reward_weights = ["rule", "rm"], [1.0, 0.5]
    b.prompts = ["p0", [{"role": "user", "content": "chat prompts travel as messages"}]]
    tx, rx = Codec(b"k" * 32, "scorer:0"), Codec(b"k" * 32, "trainer:0")
    kind, meta, arrays = b.to_message()
    got = SampleBatch.from_message(rx.decode(tx.encode(kind, meta, arrays)))
    assert got.prompt(0).tolist() == [1, 2, 3] and got.response(1).tolist() == [7, 8, 9]
    assert got.reward_total.tolist() == [1.25, 1.0] and got.rewards.tolist() == [[1.0, 0.5], [0.0, 2.0]]
    assert got.fields == [{"topic": "x"}] * 2 and got.policy_version.tolist() == [3, 3]
    assert got.prompts == b.prompts and got.reward_names == ["rule", "rm"]
    # one serialisation: the parts rebuild the same batch
    meta, arrays = got.parts()
    assert set(arrays) == {"prompt_ids", "group_index", "sample_index", "policy_version", "prompt_tokens",
                           "prompt_offsets", "response_tokens", "response_offsets", "behaviour_logprobs", "finished",
                           "ref_logprobs", "rewards", "reward_total"}
    again = SampleBatch.from_parts(meta, arrays)
    assert again.prompts == b.prompts and again.response(0).tolist() == [5, 6]


def test_concat_and_select():
    a, b = batch(), batch(prompts=([9, 9],), responses=([1],), group=(2,))
    both = SampleBatch.concat([a, b])
    assert len(both) == 3 and both.response(2).tolist() == [1] and both.prompt(2).tolist() == [9, 9]
    assert both.response_offsets.tolist() == [0, 2, 5, 6]
    picked = both.select(np.array([2, 0]))
    assert picked.response(0).tolist() == [1] and picked.response(1).tolist() == [5, 6]
    assert picked.behaviour_logprobs.tolist() == [-0.5, -0.5, -1.5] and picked.prompts == ["p0", "p0"]


def test_padded_layout():
    # sample 0: prompt [1,2,3] + response [5,6] -> response token j scored at position 2 + j
    # sample 1: prompt [4] + response [7,8,9] -> positions 0, 1, 2
    b = batch()
    p = pad_samples(b, pad_id=0)
    assert p.input_ids.tolist() == [[1, 2, 3, 5, 6], [4, 7, 8, 9, 0]]
    assert p.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]]
    assert p.action_mask.tolist() == [[0, 0, 1, 1], [1, 1, 1, 0]]
    placed = scatter_responses(b.behaviour_logprobs, b.response_offsets, p)
    assert placed.tolist() == [[0, 0, -0.5, -1.5], [-0.5, -1.5, -2.5, 0]]
    back = gather_responses(placed, p)
    assert [x.tolist() for x in back] == [[-0.5, -1.5], [-0.5, -1.5, -2.5]]
    trimmed = p.rows(torch.tensor([0]))
    assert trimmed.input_ids.shape == (1, 5) and p.rows(torch.tensor([1])).input_ids.shape == (1, 4)


def test_token_logprobs_match_log_softmax():
    torch.manual_seed(0)
    logits = torch.randn(2, 6, 11)
    ids = torch.randint(0, 11, (2, 6))
    for temperature in (1.0, 0.7):
        expected = (logits[:, :-1] / temperature).log_softmax(-1).gather(-1, ids[:, 1:, None])[..., 0]
        assert torch.allclose(token_logprobs(logits, ids, temperature), expected, atol=1e-6)


def test_token_logprobs_at_temperature_1_make_no_copy_of_the_logits_to_divide_them():
    """logits / 1 is the logits: that division copied the largest tensor of every pass, for nothing."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    logits, ids = torch.randn(2, 6, 11), torch.randint(0, 11, (2, 6))
    for temperature, divisions in ((1.0, 0), (0.7, 1)):
        with Ops() as ops:
            got = token_logprobs(logits, ids, temperature)
        assert ops.names.count("div") == divisions, ops.names
        expected = (logits[:, :-1] / temperature).log_softmax(-1).gather(-1, ids[:, 1:, None])[..., 0]
        assert torch.allclose(got, expected, atol=1e-6)


def test_forward_passes_group_samples_by_length():
    from toolkit.modeling import by_length

    lengths = [5, 90, 7, 60, 88, 6, 61, 3, 89]
    passes = by_length(lengths, 3)
    assert [p.tolist() for p in passes] == [[1, 8, 4], [6, 3, 2], [5, 0, 7]]  # ties keep arrival order
    assert len(by_length(lengths, 4)) == 3  # the count decides the passes, as ZeRO-3 ranks need


def test_scores_come_back_in_sample_order_whatever_the_passes():
    from toolkit.modeling import sequence_logprobs

    class Echo(torch.nn.Module):  # logits that make log p(next token) depend on the token and its position
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))

        def forward(self, input_ids, attention_mask, use_cache=None):
            position = torch.arange(input_ids.shape[1], dtype=torch.float32)
            logits = torch.nn.functional.one_hot(input_ids, 16).float() * position[None, :, None]
            return type("Out", (), {"logits": logits})()

    prompts = ([1, 2, 3], [4], [5, 6], [1])
    responses = ([5, 6], [7, 8, 9, 10, 11, 12], [3], [2, 2, 2])
    padded = pad_samples(batch(prompts=prompts, responses=responses, group=(0, 1, 2, 3)), 0)
    one_pass = sequence_logprobs(Echo(), padded, 1.0, 4)
    for size in (1, 2, 3):
        assert torch.equal(sequence_logprobs(Echo(), padded, 1.0, size), one_pass)
    assert (one_pass * (1 - padded.action_mask)).abs().sum() == 0 and (one_pass * padded.action_mask).abs().sum() > 0


def test_scoring_passes_build_no_kv_cache(tiny):
    """No-gradient passes (reference and old log-probs, reward-model scores, values) need no KV cache: built
    because the models' configs say use_cache, it held the keys and values of every layer to the end of
    each pass (the peak memory of a pass over 8 x 2048 tokens of an 8-layer model: +862 MB against +400)."""
    from transformers import AutoModelForCausalLM

    from toolkit.modeling import ScoreModel, last_token_scores, sequence_logprobs

    actor = AutoModelForCausalLM.from_pretrained(tiny / "model").eval()
    rm = ScoreModel(str(tiny / "reward_model"), torch.float32).eval()
    assert actor.config.use_cache and rm.model.config.use_cache  # (as the models ship)
    caches = []
    for model in (actor.model, rm.model.base_model):
        model.register_forward_hook(lambda module, args, out: caches.append(out.past_key_values))
    padded = pad_samples(batch(prompts=([1, 5, 9], [4]), responses=([7, 8], [6, 6, 6])), 0)
    for packing in (False, True):
        assert sequence_logprobs(actor, padded, 1.0, 2, packing).abs().sum() > 0
        assert last_token_scores(rm, [[1, 5, 9, 7], [4, 6]], 0, 2, torch.device("cpu"), packing).abs().sum() > 0
    assert len(caches) == 4 and all(c is None for c in caches), caches


def test_token_budget_micro_batches_hold_at_most_the_budget_longest_first():
    from toolkit.roles.update import split_to, token_budget_batches

    lengths = np.array([10, 50, 20, 50, 30, 5, 40, 25])
    batches = token_budget_batches(lengths, np.arange(8), budget=100)
    assert sorted(np.concatenate(batches).tolist()) == list(range(8))  # every sample once
    assert [b.tolist() for b in batches] == [[1, 3], [6, 4], [7, 2, 0, 5]]  # longest first
    assert all(len(b) * lengths[b].max() <= 100 for b in batches)
    assert [b.tolist() for b in token_budget_batches(lengths, np.array([1, 5]), budget=30)] == [[1], [5]]
    split = split_to(batches, 5)  # (another rank needs 5): the one of most rows (the first of those: its
    assert [b.tolist() for b in split] == [[1], [3], [6, 4], [7, 2], [0, 5]]  # samples are longest) is halved
    assert sorted(np.concatenate(split).tolist()) == list(range(8))
