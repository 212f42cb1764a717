"""Parameter counts from config.json (placement/shapes.py) against the model transformers builds on the
meta device: every family, with config.json files of public models (tests/fixtures/model_configs, their
sources in SOURCES.md) and the tiny random models of the architecture tests."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from toolkit.errors import ConfigError
from toolkit.placement.cost import ModelShape, Workload
from toolkit.placement.shapes import FAMILIES, count
from toolkit.tiny import FAMILIES as TINY

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "fixtures" / "model_configs").glob("*.json"))


def built(config: dict) -> tuple[int, int]:
    """(total, active) parameters of the model transformers builds from `config` on the meta device;
    active: the experts of each mixture-of-experts layer counted top-k / number of experts."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    c = dict(config)
    cfg = AutoConfig.for_model(c.pop("model_type"), **{k: v for k, v in c.items() if k != "architectures"})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for name, p in model.named_parameters() if ".experts." in name)
    n = config.get("num_local_experts") or config.get("num_experts")
    active = total - experts * (1 - config["num_experts_per_tok"] / n) if experts else total
    return total, active


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_counts_of_public_models_match_transformers(path):
    config = json.loads(path.read_text())
    ours = count(config, str(path))
    total, active = built(config)
    assert abs(ours.total - total) / total < 0.01, (ours.total, total)
    assert abs(ours.active - active) / active < 0.01, (ours.active, active)


def test_every_family_has_a_public_config():
    families = {json.loads(p.read_text())["model_type"] for p in CONFIGS}
    assert {"llama", "mistral", "qwen2", "opt", "gpt2", "gpt_neox"} <= families, families
    assert families & {"gemma", "gemma2"} and families & {"mixtral", "qwen2_moe", "qwen3_moe"}, families


@pytest.mark.parametrize("family", sorted(TINY), ids=sorted(TINY))
def test_counts_of_the_tiny_families_match_transformers(family):
    """The configs of the tiny random models the architecture tests run, exactly."""
    import transformers

    class_name, args = TINY[family]
    config = getattr(transformers, class_name)(**args).to_dict()
    ours = count(config)
    total, active = built(config)
    assert ours.total == total and abs(ours.active - active) < 1


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_critics_and_reward_models_count_a_score_head_not_an_lm_head(path):
    """A critic or reward model is transformers' ...ForSequenceClassification (one label): no LM head, a
    score head of hidden x 1 (OPT: of its projection's width). Meta-Llama-3-8B's was counted with its
    untied 525M LM head (+7.0%)."""
    import torch
    from transformers import AutoConfig, AutoModelForSequenceClassification

    config = json.loads(path.read_text())
    c = dict(config)
    cfg = AutoConfig.for_model(c.pop("model_type"), **{k: v for k, v in c.items() if k != "architectures"})
    cfg.num_labels = 1
    with torch.device("meta"):
        built_params = sum(p.numel() for p in AutoModelForSequenceClassification.from_config(cfg).parameters())
    shape = ModelShape.from_config(path)
    critic = Workload(actor=shape, reference=shape, critic=shape, reward_models=(shape,), samples=1, prompts=1,
                      prompt_tokens=1, response_tokens=1).critic
    assert abs(critic.params - built_params) / built_params < 0.01, (critic.params, built_params)
    assert critic.params == shape.params - shape.lm_head + critic.score_inputs and critic.outputs == 1


def peft_adapters(config: dict, targets) -> int:
    """Parameters peft gives LoRA of rank 16 on `targets` (its target_modules) of the model transformers builds
    from `config` on the meta device."""
    import warnings

    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    c = dict(config)
    cfg = AutoConfig.for_model(c.pop("model_type"), **{k: v for k, v in c.items() if k != "architectures"})
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (peft on a mixture's fused experts)
        model = get_peft_model(AutoModelForCausalLM.from_config(cfg), LoraConfig(r=16, target_modules=targets))
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def test_lora_adapters_of_mixtures_are_each_experts():
    """peft 0.21 (rank 16, all-linear) on Mixtral-8x7B and Qwen3-30B-A3B as transformers 5 builds them gave
    359,665,664 and 996,507,648 adapter parameters; counting one gated MLP a layer gave 41.9M and 16.7M."""
    fixtures = Path(__file__).resolve().parents[1] / "fixtures" / "model_configs"
    assert ModelShape.from_config(fixtures / "mistralai--Mixtral-8x7B-v0.1.json").lora_params(16) == 359_665_664
    assert ModelShape.from_config(fixtures / "Qwen--Qwen3-30B-A3B.json").lora_params(16) == 996_507_648


# A target_modules list for each family: layers of attention and of the MLP (a mixture: its router and experts)
LISTS = {"opt": ["q_proj", "fc2"], "gpt2": ["c_attn", "c_fc"], "gpt_neox": ["query_key_value", "dense_4h_to_h"],
         "mixtral": ["q_proj", "gate", "w2"], "qwen3_moe": ["k_proj", "gate", "down_proj"]}


def tiny_config(family: str) -> dict:
    import transformers

    class_name, args = TINY[family]
    return getattr(transformers, class_name)(**args).to_dict()


@pytest.mark.parametrize("config", [json.loads(p.read_text()) for p in CONFIGS]
                         + [tiny_config(f) for f in sorted(TINY)],
                         ids=[p.stem for p in CONFIGS] + [f"tiny-{f}" for f in sorted(TINY)])
def test_lora_adapters_are_what_peft_gives_every_family_and_mixtures_each_expert(config, tmp_path):
    """LoRA's adapters as peft counts them (rank 16): on every linear layer of the blocks (all-linear: OPT's,
    GPT-2's and GPT-NeoX's two MLP matrices; each expert of a mixture, its router, a shared expert), and on
    the layers a list names."""
    (tmp_path / "config.json").write_text(json.dumps(config))
    shape = ModelShape.from_config(tmp_path)
    targets = LISTS.get(config["model_type"], ["q_proj", "v_proj", "down_proj"])
    assert shape.lora_params(16) == peft_adapters(config, "all-linear")
    assert shape.lora_params(16, tuple(targets)) == peft_adapters(config, targets)


def test_an_unknown_architecture_says_what_to_pass(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "bloom", "architectures": ["BloomForCausalLM"], "hidden_size": 64}))
    with pytest.raises(ConfigError, match=r"model_type 'bloom' \(BloomForCausalLM\) is not one the planner counts.*"
                                          r"--params actor=7e9"):
        ModelShape.from_config(tmp_path)
    assert "llama" in FAMILIES and "opt" in FAMILIES


def test_sizes_that_are_not_counts_are_named(tmp_path):
    """null, 0, "4096" or 32.0 where a count goes: a TypeError or ZeroDivisionError out of `plan` and `init`."""
    llama = json.loads((Path(__file__).parents[1] / "fixtures" / "model_configs" / "meta-llama--Llama-2-7b-hf.json")
                       .read_text())
    for key, value in (("num_attention_heads", None), ("num_attention_heads", 0), ("hidden_size", "4096"),
                       ("num_hidden_layers", 32.0)):
        (tmp_path / "config.json").write_text(json.dumps({**llama, key: value}))
        with pytest.raises(ConfigError, match=f"config.json: a llama config whose sizes are not all whole numbers "
                                              f"above 0 .*\"{key}\": {json.dumps(value)}"):
            ModelShape.from_config(tmp_path)


def test_sizes_of_0_below_0_or_true_and_configs_that_are_no_object_are_config_errors(tmp_path):
    """A negative or zero layer count gave a count of 0.262B, a negative hidden size -2.4B, `true` layers
    0.465B, all without an error; a config.json of [1, 2], null or cut-off JSON was a traceback."""
    llama = json.loads((Path(__file__).parents[1] / "fixtures" / "model_configs" / "meta-llama--Llama-2-7b-hf.json")
                       .read_text())
    for key, value, says in (("num_hidden_layers", -2, "num_hidden_layers is -2"),
                             ("num_hidden_layers", 0, "num_hidden_layers is 0"),
                             ("hidden_size", -4096, "hidden_size is -4096"), ("vocab_size", 0, "vocab_size is 0"),
                             ("num_hidden_layers", True, "num_hidden_layers is true"),
                             ("num_key_value_heads", 3,
                              "num_key_value_heads 3 does not divide num_attention_heads 32")):
        (tmp_path / "config.json").write_text(json.dumps({**llama, key: value}))
        with pytest.raises(ConfigError, match=f"config.json: a llama config whose sizes are not all whole numbers "
                                              f"above 0 \\({says}\\)"):
            ModelShape.from_config(tmp_path)
    for text, says in (("[1, 2]", "not list"), ("null", "not NoneType"), ("{", "not JSON")):
        (tmp_path / "config.json").write_text(text)
        with pytest.raises(ConfigError, match=f"config.json: .*{says}"):
            ModelShape.from_config(tmp_path)


def test_a_cluster_file_not_in_utf8_is_named(tmp_path):
    from toolkit.placement.cluster import load_cluster

    path = tmp_path / "c.yaml"
    path.write_bytes(b"name: ours\n# Cluster de l\xe9quipe\n")  # (Latin-1)
    with pytest.raises(ConfigError, match=r"c.yaml: not UTF-8 text \(byte 25: b'\\xe9'\); a cluster file is a YAML"):
        load_cluster(path)
