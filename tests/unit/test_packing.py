"""model.packing: samples laid end to end in one sequence give the padded layout's log-probs and gradients,
and the per-token tensors map between the two layouts."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from toolkit.modeling import right_pad, token_logprobs
from toolkit.packing import inside, pack
from toolkit.roles.update import token_budget_batches

LENGTHS = (5, 13, 9, 1, 20)


def _rows(vocab: int):
    torch.manual_seed(0)
    return right_pad([torch.randint(3, vocab, (n,)).tolist() for n in LENGTHS], 0)


def test_pack_lays_samples_end_to_end_and_maps_per_token_tensors_both_ways():
    ids, attention = _rows(50)
    packed = pack(ids, attention)
    assert packed.bounds == [0, 5, 18, 27, 28, 48]
    assert packed.input_ids.tolist() == [[t for row, n in zip(ids.tolist(), LENGTHS) for t in row[:n]]]
    assert packed.position_ids[0, 5:8].tolist() == [0, 1, 2] and packed.position_ids[0, 27].item() == 0
    per_token = torch.arange(5 * 19, dtype=torch.float32).reshape(5, 19) + 1  # [B, T-1]
    within = torch.zeros(5, 19)
    for i, n in enumerate(LENGTHS):
        within[i, : n - 1] = 1
    taken = packed.take(per_token)
    assert taken.shape == (1, 47)
    # position k scores token k+1: inside a sample it is that row's value, at a sample's last token 0
    assert taken[0, :4].tolist() == per_token[0, :4].tolist() and taken[0, 4].item() == 0
    assert taken[0, 5:17].tolist() == per_token[1, :12].tolist() and taken[0, 17].item() == 0
    assert taken[0, 27].item() == 0  # the one-token sample has no position of its own
    assert torch.equal(packed.put(taken, 19), per_token * within)


@pytest.mark.parametrize("family", ["llama", "llama-checkpointed", "llama-checkpointed-thread", "llama-lora", "gpt2",
                                    "mistral-window"])
def test_packed_forward_and_backward_equal_the_padded_ones(family):
    """Grouped-query attention and rotary positions (Llama), the same with activation checkpointing (the
    forward pass runs again in the backward pass, inside `inside` too; on a GPU autograd runs the backward
    pass on a thread of its own per device, which `-thread` does here) and inside peft's LoRA wrapper,
    learned absolute positions (GPT-2), and a sliding window shorter than a sample (Mistral): the same
    log-probs and gradients within 1e-5."""
    import transformers

    shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=50)
    llama = lambda: transformers.LlamaConfig(**shape, num_key_value_heads=2)  # noqa: E731
    config = {"llama": llama, "llama-checkpointed": llama, "llama-checkpointed-thread": llama, "llama-lora": llama,
              "gpt2": lambda: transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=50, attn_pdrop=0,
                                                      resid_pdrop=0, embd_pdrop=0),
              "mistral-window": lambda: transformers.MistralConfig(**shape, num_key_value_heads=2, sliding_window=6),
              }[family]()
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").train()
    if "checkpointed" in family:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if family.endswith("lora"):
        import peft

        model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False))
    ids, attention = _rows(50)
    padded = token_logprobs(model(input_ids=ids, attention_mask=attention).logits, ids, 0.7)
    mask = torch.zeros_like(padded)
    for i, n in enumerate(LENGTHS):
        mask[i, : n - 1] = 1
    (padded * mask).sum().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.requires_grad}
    model.zero_grad()
    packed = pack(ids, attention)
    with inside([model], packed):
        logprobs = token_logprobs(model(input_ids=packed.input_ids, position_ids=packed.position_ids).logits,
                                  packed.input_ids, 0.7)
        loss = (logprobs * packed.take(mask)).sum()
        if family.endswith("thread"):
            from concurrent.futures import ThreadPoolExecutor

            with ThreadPoolExecutor(1) as pool:
                pool.submit(loss.backward).result()
        else:
            loss.backward()
    assert model.config._attn_implementation == "sdpa"  # restored after the block
    assert ((packed.put(logprobs, padded.shape[1]) - padded) * mask).abs().max().item() < 1e-5
    trained = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    assert max((grads[name] - p.grad).abs().max().item() for name, p in trained) < 1e-5


def test_a_packed_token_budget_counts_the_samples_own_tokens():
    lengths = np.array([10, 40, 25, 5, 30, 12])
    index = np.arange(6)
    # padded, rows x the longest <= 70: 1 x 40, 2 x 30, 4 x 12; packed, the sum <= 70: 40 + 30, 25 + 12 + 10 + 5
    assert [b.tolist() for b in token_budget_batches(lengths, index, 70)] == [[1], [4, 2], [5, 0, 3]]
    assert [b.tolist() for b in token_budget_batches(lengths, index, 70, packed=True)] == [[1, 4], [2, 5, 0, 3]]
    assert [b.tolist() for b in token_budget_batches(lengths, index, 30, packed=True)][0] == [1]  # longer: alone


def test_packed_reward_model_scores_equal_the_padded_ones(tiny):
    """A reward model (a ScoreModel) reads each sequence's score at its last token, packed or padded."""
    from toolkit.modeling import ScoreModel, last_token_scores

    model = ScoreModel(str(tiny / "reward_model"), torch.float32).eval()
    torch.manual_seed(1)
    sequences = [torch.randint(3, 200, (n,)).tolist() for n in (7, 30, 2, 18, 11)]
    padded = last_token_scores(model, sequences, 0, 3, torch.device("cpu"))
    packed = last_token_scores(model, sequences, 0, 3, torch.device("cpu"), packing=True)
    assert padded.std() > 0 and (packed - padded).abs().max().item() < 1e-5


_DECODER = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=50)
_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
SHAPES = {"llama": _DECODER, "mistral": _DECODER, "qwen2": _DECODER, "qwen3": dict(_DECODER, head_dim=16),
          "gemma": dict(_DECODER, head_dim=16), "mixtral": dict(_DECODER, num_local_experts=4, num_experts_per_tok=2),
          "qwen2_moe": dict(_DECODER, **_MOE, shared_expert_intermediate_size=64),
          "qwen3_moe": dict(_DECODER, **_MOE, head_dim=16),
          "opt": dict(hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=50,
                      word_embed_proj_dim=64),
          "gpt2": dict(n_embd=64, n_layer=2, n_head=4, vocab_size=50),
          "gpt_neox": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                           vocab_size=50, rotary_pct=0.25)}


@pytest.mark.parametrize("family", sorted(SHAPES))
def test_every_family_packing_is_allowed_for_scores_packed_samples_as_padded_ones(family):
    """The families config validation lets pack (PACKED_FAMILIES) are these, and each one's packed log-probs
    equal its padded ones: no layer reads across a sample's bounds."""
    import transformers

    from toolkit.config.model_files import PACKED_FAMILIES

    assert set(SHAPES) == set(PACKED_FAMILIES)
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(family, **SHAPES[family])
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    ids, attention = _rows(50)
    with torch.no_grad():
        padded = token_logprobs(model(input_ids=ids, attention_mask=attention).logits, ids, 1.0)
        packed = pack(ids, attention)
        with inside([model], packed):
            logprobs = token_logprobs(model(input_ids=packed.input_ids, position_ids=packed.position_ids).logits,
                                      packed.input_ids, 1.0)
    mask = torch.zeros_like(padded)
    for i, n in enumerate(LENGTHS):
        mask[i, : n - 1] = 1
    assert ((packed.put(logprobs, padded.shape[1]) - padded) * mask).abs().max().item() < 1e-5


def test_sft_batches_count_the_targets_their_loss_averages_packed_or_padded(tiny):
    """A row whose response fills train.max_tokens loses its whole prompt, and its first token is no target.
    Its micro-batch's `targets`, which weigh the micro-batch in its step, counted one there when padded (13
    here, against the loss's 12): micro-batches of 1 then trained another gradient than one of 2."""
    from types import SimpleNamespace

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from toolkit.training.sft import SFTTask

    tokenizer = AutoTokenizer.from_pretrained(tiny / "model")
    task = SFTTask(SimpleNamespace(data=SimpleNamespace(chat_template=False), train=SimpleNamespace(max_tokens=8)),
                   tokenizer)
    rows = [SimpleNamespace(prompt="Question about trains?", response="into 99"),
            SimpleNamespace(prompt="A short note on bridges:", response="17 403 968 no 93 56 my")]
    assert [task.tokens(row)[1] for row in rows] == [3, 0]  # (the second: 8 tokens of response, no prompt)
    model = AutoModelForCausalLM.from_pretrained(tiny / "model").eval()

    def step_gradient(micro_batch_size: int) -> torch.Tensor:  # (as SupervisedRole._train_step weighs them)
        model.zero_grad()
        batches = [task.batch(rows[i: i + micro_batch_size]) for i in range(0, len(rows), micro_batch_size)]
        everywhere = sum(b["targets"] for b in batches)
        for b in batches:
            loss, stats = task.loss(model, b, "cpu")
            assert b["targets"] == stats["target_tokens"]
            (loss * b["targets"] / everywhere).backward()
        return torch.cat([p.grad.flatten() for p in model.parameters()])

    assert [task.batch(rows, packing=packing)["targets"] for packing in (False, True)] == [12, 12]  # 5 + 7
    one, two = step_gradient(1), step_gradient(2)
    assert (one - two).norm().item() < 1e-5 * two.norm().item()


def test_supervised_batches_count_the_rows_train_max_tokens_cut(tiny):
    """SFT and RM cut rows longer than train.max_tokens (the prompt from the left first), as documented, but
    silently: a stage whose data mostly did not fit trained on cut rows and no metric said so. Each batch now
    counts them (`cut_rows`, a step metric; RM: the pairs with either side cut)."""
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    from toolkit.data.tokens import render_prompt, response_ids
    from toolkit.training.rm import RMTask
    from toolkit.training.sft import SFTTask

    tokenizer = AutoTokenizer.from_pretrained(tiny / "model")
    cfg = SimpleNamespace(data=SimpleNamespace(chat_template=False), train=SimpleNamespace(max_tokens=8))
    long, short = ("Question about trains?", "into 99"), ("Hi", "ok")
    assert [len(render_prompt(tokenizer, p, False)) + len(response_ids(tokenizer, r)) for p, r in (long, short)] \
        == [14, 5]  # (one over 8 tokens, one within)
    sft = SFTTask(cfg, tokenizer)
    rows = [SimpleNamespace(prompt=p, response=r) for p, r in (long, short, long)]
    assert [sft.batch(rows, packing=packing)["cut_rows"] for packing in (False, True)] == [2, 2]
    rm = RMTask(cfg, tokenizer)
    pairs = [SimpleNamespace(prompt="Hi", chosen="ok", rejected="no"),
             SimpleNamespace(prompt="Hi", chosen="ok", rejected=long[1] * 3),
             SimpleNamespace(prompt=long[0], chosen=long[1] * 3, rejected=long[1] * 3)]
    assert rm.batch(pairs)["cut_rows"] == 2
