"""Config: validation errors name file, line, field, value and what is allowed; overrides; exit code 2."""

from __future__ import annotations

import json
import os
import re
import shutil

import pytest
import yaml

from tests.conftest import REPO, cli, example, write_config
from toolkit.config import dump_config, load_config
from toolkit.config.base import load_function
from toolkit.errors import ConfigError


def error_of(path, overrides=()) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides)
    assert info.value.exit_code == 2
    return str(info.value)


def test_example_configs_load(tiny, tmp_path):
    for name in ("tiny-grpo.yaml", "tiny-ppo.yaml"):
        cfg = load_config(write_config(tmp_path, example(name, tiny)))
        assert cfg.samples_per_step == cfg.rollout.prompts_per_step * cfg.rollout.group_size


def test_unknown_key_names_line_and_allowed_keys(tiny, tmp_path):
    data = example("tiny-grpo.yaml", tiny)
    data["rollout"]["gruop_size"] = 4
    path = write_config(tmp_path, data)
    line = next(i for i, text in enumerate(path.read_text().splitlines(), 1) if "gruop_size" in text)
    msg = error_of(path)
    assert f"{path}:{line}: rollout.gruop_size: unknown key 'gruop_size'" in msg
    assert "group_size" in msg and "max_new_tokens" in msg  # the allowed keys are listed


def test_wrong_type_and_bad_value(tiny, tmp_path):
    data = example("tiny-grpo.yaml", tiny)
    data["rollout"]["max_new_tokens"] = "many"
    data["run"]["algorithm"] = "dpo"
    msg = error_of(write_config(tmp_path, data))
    assert "rollout.max_new_tokens: got 'many'" in msg and "integer" in msg
    assert "run.algorithm: got 'dpo'" in msg and "'grpo', 'ppo', 'rloo' or 'reinforce_pp'" in msg


def test_a_boolean_is_not_a_number(tiny, tmp_path):
    """true/false where a number goes is refused, naming the field (pydantic's lax mode read true as 1 and false
    as 0: `--set trainer.lr=true` trained at lr 1.0, `trainer.zero_stage=false` ran ZeRO-0); a number that
    PyYAML reads as a string (1e-6) still converts, and a boolean field still takes a boolean."""
    path = write_config(tmp_path, example("tiny-grpo.yaml", tiny))
    for expr, field in [("trainer.lr=true", "trainer.lr: got True"), ("trainer.zero_stage=false",
                        "trainer.zero_stage: got False"), ("run.steps=true", "run.steps: got True"),
                        ("trainer.ema=yes", "trainer.ema: got True")]:
        msg = error_of(path, [expr])
        assert f"--set {expr}: {field}: a number goes here, not true or false" in msg, msg
    cfg = load_config(path, ["trainer.lr=1e-6", "trainer.gradient_checkpointing=true", "run.deterministic=on"])
    assert cfg.trainer.lr == pytest.approx(1e-6) and cfg.trainer.gradient_checkpointing and cfg.run.deterministic
    assert cfg.slurm.sbatch == {} and load_config(path, ["slurm.sbatch.exclusive=true"]).slurm.sbatch == {
        "exclusive": True}  # (a value that may be a boolean stays one)


def test_a_yaml_boolean_where_text_goes_says_to_quote_it(tiny, tmp_path):
    """YAML 1.1 reads `off`, `yes` and `on` as booleans: `run.name: off` was "got False: input should be a valid
    string", which does not say where the False came from."""
    path = write_config(tmp_path, example("tiny-grpo.yaml", tiny))
    for expr, field in [("run.name=off", "run.name: got False: input should be a valid string"),
                        ("rollout.backend=on", "rollout.backend: got True: input should be 'auto', 'vllm' or 'hf'")]:
        assert f"--set {expr}: {field}; YAML reads yes, no, on, off, true and false as true or false: quote the " \
               "word to give it as text ('off', not off)" in error_of(path, [expr])
    assert load_config(path, ["run.name='off'"]).run.name == "off"


def test_batch_not_divisible(tiny, tmp_path):
    data = example("tiny-grpo.yaml", tiny, rollout={"prompts_per_step": 10, "group_size": 3})
    msg = error_of(write_config(tmp_path, data))
    assert "a step has 30 samples" in msg and "trainer.micro_batch_size 16" in msg
    # By token budget a rank's samples of an update are cut by their tokens: micro_batch_size need not divide
    # them (it was asked to), the trainer ranks and updates still must.
    data["trainer"].update(micro_batch_tokens=10**4, updates_per_step=2)
    load_config(write_config(tmp_path, data))  # (30 samples, not a multiple of 16)
    msg = error_of(write_config(tmp_path, {**data, "rollout": {**data["rollout"], "prompts_per_step": 9}}))
    assert "a step has 27 samples" in msg and "micro_batch_size" not in msg, msg
    assert "not divisible by trainer workers 1 x trainer.updates_per_step 2 = 2" in msg, msg


def test_grpo_needs_groups(tiny, tmp_path):
    data = example("tiny-grpo.yaml", tiny, rollout={"group_size": 1, "prompts_per_step": 16})
    assert "GRPO needs >= 2 samples per prompt" in error_of(write_config(tmp_path, data))


def test_missing_model_path(tiny, tmp_path):
    data = example("tiny-grpo.yaml", tiny)
    data["model"]["actor"] = "no/such/model"
    path = write_config(tmp_path, data)
    msg = error_of(path)
    assert "model.actor: got 'no/such/model': no such directory" in msg
    assert str(tmp_path / "no/such/model") in msg  # resolved against the config's directory
    assert f"data.prompts: got '{tmp_path}': '{tmp_path}' is a directory, not a file" in error_of(
        path, [f"data.prompts={tmp_path}", f"model.actor={tiny / 'model'}"])


def test_a_path_given_by_set_is_relative_to_the_current_folder(tiny, tmp_path, monkeypatch):
    """A relative path in the file resolves against the file's folder; one typed after --set, against the
    folder the command runs in, as in the shell (it was the config's folder: `--set model.actor=models/x`
    from the repository's root looked in templates/examples/models/x). Sections and lists given whole, a
    rule file's path, and a pipeline's stage names (kept as references) too."""
    from tests.conftest import EXAMPLES
    from toolkit.config.pipeline import load_pipeline

    data = example("tiny-grpo.yaml", tiny)
    data["data"]["prompts"] = "prompts.jsonl"  # (relative in the file: beside the config)
    shutil.copy(tiny / "prompts.jsonl", tmp_path / "prompts.jsonl")
    path = write_config(tmp_path / "configs", data)
    shutil.copy(tiny / "prompts.jsonl", tmp_path / "configs" / "prompts.jsonl")
    (tmp_path / "rules.py").write_text("def zero(samples):\n    return [0.0 for _ in samples]\n")
    monkeypatch.chdir(tmp_path)
    shutil.copytree(tiny / "model", tmp_path / "models" / "actor")
    cfg = load_config(path, ["model.actor=models/actor", "model.reference=./models/actor",
                             "reward.functions=[{function: rules.py:zero}]"])
    assert cfg.model.actor == cfg.model.reference == str(tmp_path / "models" / "actor")
    assert cfg.data.sources[0].path == str(tmp_path / "configs" / "prompts.jsonl")
    assert cfg.reward.functions[0].function == f"{tmp_path / 'rules.py'}:zero"
    assert load_config(path, ["reward.functions.0.function=rules.py:zero"]).reward.functions[0].function == \
        f"{tmp_path / 'rules.py'}:zero"
    assert load_config(path, ["data.prompts=prompts.jsonl"]).data.sources[0].path == str(tmp_path / "prompts.jsonl")
    msg = error_of(path, ["model.critic=models/none"])
    assert f"--set model.critic=models/none: model.critic: got '{tmp_path / 'models' / 'none'}': no such" in msg
    (tmp_path / "pipeline.jsonl").write_text((tiny / "pipeline.jsonl").read_text())
    pipeline = load_pipeline(EXAMPLES / "tiny-pipeline.yaml", [
        "sft.model.base=models/actor", "rl.model.actor=sft", "data.sources=[{path: pipeline.jsonl}]",
        "rl.reward.models.0.path=rm"])
    sft, rm, rl = pipeline.configs(tmp_path / "pipeline")
    assert sft.model.base == str(tmp_path / "models" / "actor")
    assert sft.data.sources[0].path == rl.data.sources[0].path == str(tmp_path / "pipeline.jsonl")
    assert rl.model.actor == str(tmp_path / "pipeline" / "sft" / "export")
    assert rl.reward.models[0].path == str(tmp_path / "pipeline" / "rm" / "export")


def test_a_model_with_the_wrong_head_is_a_config_error(tiny, tmp_path):
    """transformers gives a reward model as the actor a new random LM head, and a causal LM as a reward model
    a new random score head, with a warning at most: validation refuses both, and names the pipeline stage
    that exports the wrong kind; init and generate/chat refuse them too."""
    from tests.conftest import EXAMPLES
    from toolkit.config.pipeline import load_pipeline

    lm, rm = str(tiny / "model"), str(tiny / "reward_model")
    path = write_config(tmp_path, example("tiny-grpo.yaml", tiny))
    for overrides, expected in [([f"model.actor={rm}"], f"model.actor: {rm} is a sequence-classification model "
                                                        "(LlamaForSequenceClassification)"),
                                ([f"model.reference={rm}"], "model.reference needs a causal LM"),
                                ([f"reward.models=[{{path: {lm}}}]"], f"reward.models.0.path: {lm} is a causal LM "
                                                                      "(LlamaForCausalLM) without a score head")]:
        assert expected in error_of(path, overrides)
    cfg = load_config(path, [f"reward.models=[{{path: {rm}}}]", "run.algorithm=ppo", f"model.critic={rm}"])
    assert cfg.model.critic == rm  # (a critic starts from either)
    sft = {"stage": "sft", "run": {"steps": 2}, "data": {"sources": [{"path": str(tiny / "pipeline.jsonl")}]},
           "model": {"base": rm}}
    assert "model.base: " + rm + " is a sequence-classification model" in error_of(write_config(tmp_path, sft, "s.yaml"))
    for override, expected in [("rl.model.actor=rm", "rl.model.actor: the rm stage exports a reward model, but this "
                                                     "field takes a causal LM: name 'sft'"),
                               ("rl.reward.models.0.path=sft", "rl.reward.models.0.path: the sft stage exports a causal "
                                                               "LM, but this field takes a reward model: name 'rm'")]:
        with pytest.raises(ConfigError, match=re.escape(expected)):
            load_pipeline(EXAMPLES / "tiny-pipeline.yaml", [override]).configs(tmp_path / "pipeline")
    from toolkit.config.starter import write_starter  # (init names its flag, before anything is written)

    with pytest.raises(ConfigError, match=re.escape(f"--reward-model: {lm} is a causal LM")):
        write_starter(lm, str(tmp_path / "init.yaml"), reward_model=lm)
    with pytest.raises(ConfigError, match=re.escape(f"--model: {rm} is a sequence-classification model")):
        write_starter(rm, str(tmp_path / "init.yaml"))
    assert not list(tmp_path.glob("*init.yaml*"))
    from toolkit.use.sampler import Sampler  # (generate and chat)

    with pytest.raises(ConfigError, match=re.escape(f"MODEL: {rm} is a sequence-classification model")):
        Sampler(tiny / "reward_model", backend="hf")


def test_a_classifier_of_several_labels_is_no_reward_model(tiny, tmp_path):
    """A sequence classifier of 2 labels (a sentiment model, say) passed validation as a reward model, a critic
    or the rm stage's base, and the scorer or trainer failed as it loaded it, with transformers' "You set
    `ignore_mismatched_sizes` to `False`" and no field named. The labels are the score head's rows in the
    checkpoint (transformers writes no id2label for 2 default labels); a config.json that names none does not
    make a one-label reward model a classifier."""
    import json
    import shutil

    from transformers import AutoModelForSequenceClassification

    path = write_config(tmp_path, example("tiny-grpo.yaml", tiny))
    for labels in (2, 3):
        rm = tmp_path / f"rm{labels}"
        shutil.copytree(tiny / "reward_model", rm)
        named = {} if labels == 2 else {"id2label": dict(enumerate("abc"))}
        AutoModelForSequenceClassification.from_pretrained(rm, num_labels=labels, ignore_mismatched_sizes=True,
                                                           **named).save_pretrained(rm)
        expected = f"is a classifier with {labels} labels (LlamaForSequenceClassification); a reward model or critic"
        assert f"reward.models.0.path: {rm} {expected}" in error_of(path, [f"reward.models=[{{path: {rm}}}]"])
        assert f"model.critic: {rm} {expected}" in error_of(path, ["run.algorithm=ppo", f"model.critic={rm}"])
        stage = {"stage": "rm", "run": {"steps": 2}, "data": {"sources": [{"path": str(tiny / "pipeline.jsonl")}]},
                 "model": {"base": str(rm)}}  # (the rm stage trains it: the same load)
        assert f"model.base: {rm} {expected}" in error_of(write_config(tmp_path, stage, "rm.yaml"))
    one = tmp_path / "one"
    shutil.copytree(tiny / "reward_model", one)
    config = json.loads((one / "config.json").read_text())
    del config["id2label"], config["label2id"]
    (one / "config.json").write_text(json.dumps(config))
    assert load_config(path, [f"reward.models=[{{path: {one}}}]"]).reward.models[0].path == str(one)


def test_a_model_without_a_tokenizer_is_a_config_error(tiny, tmp_path):
    """A checkpoint saved without its tokenizer failed in the worker that loaded it, with transformers' advice
    to install sentencepiece; validation names the field and the way out."""
    import shutil

    from toolkit.config.starter import write_starter
    from toolkit.use.sampler import check_model

    bare, bare_rm = tmp_path / "bare", tmp_path / "bare-rm"
    for source, target in ((tiny / "model", bare), (tiny / "reward_model", bare_rm)):
        target.mkdir()
        for name in ("config.json", "model.safetensors"):
            shutil.copy(source / name, target / name)
    path = write_config(tmp_path, example("tiny-grpo.yaml", tiny))
    msg = error_of(path, [f"model.actor={bare}"])
    assert f"model.actor: {bare} holds no tokenizer (none of tokenizer.json, " in msg
    assert "or set model.tokenizer to a directory that holds it" in msg
    assert load_config(path, [f"model.actor={bare}", f"model.tokenizer={tiny / 'model'}"]).tokenizer_path == tiny / "model"
    assert f"model.tokenizer: {bare} holds no tokenizer" in error_of(path, [f"model.tokenizer={bare}"])
    msg = error_of(path, [f"reward.models=[{{path: {bare_rm}}}]"])
    assert f"reward.models.0.path: {bare_rm} holds no tokenizer" in msg and "model.tokenizer" not in msg
    sft = {"stage": "sft", "run": {"steps": 2}, "data": {"sources": [{"path": str(tiny / "pipeline.jsonl")}]},
           "model": {"base": str(bare)}}
    assert f"model.base: {bare} holds no tokenizer" in error_of(write_config(tmp_path, sft, "s.yaml"))
    with pytest.raises(ConfigError, match=re.escape(f"--model: {bare} holds no tokenizer")):
        write_starter(str(bare), str(tmp_path / "init.yaml"))
    with pytest.raises(ConfigError, match=re.escape(f"MODEL: {bare} holds no tokenizer")):
        check_model(bare)


def test_reward_function_not_importable(tiny, tmp_path):
    data = example("tiny-grpo.yaml", tiny)
    data["reward"]["functions"][0]["function"] = "nosuchpkg.rewards:score"
    assert "cannot import module 'nosuchpkg.rewards'" in error_of(write_config(tmp_path, data))
    data["reward"]["functions"][0]["function"] = "toolkit.rewards.examples:nope"
    assert "has no function 'nope'" in error_of(write_config(tmp_path, data))


def test_reward_function_from_a_file_beside_the_config(tiny, tmp_path):
    """`file.py:function` is read relative to the config's folder and kept as an absolute path (the workers
    load the same file wherever they start); two files of one name are two modules; errors name the file."""
    (tmp_path / "rewards.py").write_text("def score(prompt, response, **fields):\n    return 1.0\n")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "rewards.py").write_text("def score(prompt, response, **fields):\n    return 2.0\n")
    data = example("tiny-grpo.yaml", tiny)
    data["reward"]["functions"] = [{"function": "rewards.py:score"}, {"function": "other/rewards.py:score",
                                                                      "name": "other"}]
    cfg = load_config(write_config(tmp_path, data))
    functions = [f.function for f in cfg.reward.functions]
    assert functions == [f"{tmp_path}/rewards.py:score", f"{tmp_path}/other/rewards.py:score"]
    assert [load_function(f)("p", "r") for f in functions] == [1.0, 2.0] and cfg.reward.functions[0].name == "score"
    (tmp_path / "broken.py").write_text("def score(prompt, response, **fields):\n    return 1 +\n")
    for given, says in [("nothere.py:score", f"no such file '{tmp_path}/nothere.py'"),
                        ("rewards.py:nope", f"file '{tmp_path}/rewards.py' has no function 'nope'"),
                        ("broken.py:score", f"{tmp_path}/broken.py failed to load: SyntaxError: invalid syntax"),
                        ("rewards.py", "give `package.module:function` (importable) or `path/to/file.py:function`"),
                        ("two words:f", "give `package.module:function`")]:
        data["reward"]["functions"] = [{"function": given}]
        assert says in error_of(write_config(tmp_path, data)), given


def test_a_reward_module_that_fails_as_it_is_imported_is_named(tiny, tmp_path, monkeypatch):
    """Only ImportError was caught: a module raising anything else, or calling sys.exit, ended validation
    with a traceback (or with its own exit code and no word)."""
    (tmp_path / "raising.py").write_text("raise RuntimeError('boom at import')\ndef f(prompt, response): return 0.0\n")
    (tmp_path / "exiting.py").write_text("import sys\nsys.exit(3)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    data = example("tiny-grpo.yaml", tiny)
    for given, says in [("raising:f", "module 'raising' of 'raising:f' failed to import: RuntimeError: boom at import"),
                        ("exiting:f", "module 'exiting' of 'exiting:f' failed to import: SystemExit: 3"),
                        ("exiting.py:f", f"{tmp_path}/exiting.py failed to load: SystemExit: 3")]:
        data["reward"]["functions"] = [{"function": given}]
        assert says in error_of(write_config(tmp_path, data)), given


def test_vllm_splits_the_key_value_heads_too():
    """vLLM gives each tensor-parallel rank as many key/value heads, or copies one on several ranks: Phi-3
    medium's 10 over 8 ranks passed `validate` and the planner, and vLLM's QKVParallelLinear refused them."""
    from toolkit.config.model_files import kv_heads, tp_splits

    assert kv_heads({"num_attention_heads": 40, "num_key_value_heads": 10}) == 10
    assert kv_heads({"num_attention_heads": 40}) == kv_heads({"n_head": 40}) == 40
    assert not tp_splits(40, 10, 8) and tp_splits(40, 10, 2) and tp_splits(64, 8, 16) and tp_splits(32, 8, 8)
    assert not tp_splits(40, 40, 16) and tp_splits(None, None, 8)


@pytest.mark.parametrize("overrides, expected", [
    (["algorithm.kl.coef=.inf"], "algorithm.kl.coef: got inf: input should be a finite number"),
    (["reward.functions.0.weight=.nan"], "reward.functions.0.weight: got nan: input should be a finite number"),
    (["slurm.partition=\"gpu\\n#SBATCH --x\""], "slurm.partition: got 'gpu\\n#SBATCH --x': 'gpu\\n#SBATCH --x' holds "
                                                "a control character"),
    (["slurm.sbatch={mail-user: \"a\\nb\"}"], "holds a control character (a line break?)"),
    (["placement.trainer.env={\"A=B\": x}"], "env: 'A=B' is not an environment variable name"),
    (["placement.trainer.env={CUDA_VISIBLE_DEVICES: \"6,7\"}", "placement.trainer.gpus_per_worker=1"],
     "placement.trainer: env: CUDA_VISIBLE_DEVICES would not be used: each worker of a group with "
     "gpus_per_worker gets its own GPUs"),
    (["slurm.time_min=1"], "slurm.signal_lead_s (120 s) and stop_margin_s (15 s) do not fit in the time limit"),
    (["rollout.backend=vllm", "rollout.vllm.tensor_parallel_size=4", "placement.generator.cpus_per_worker=4"],
     "rollout.vllm.tensor_parallel_size (4) does not split the 2 attention heads and 2 key/value heads of "
     "model.actor"),
    (["data.chosen_key=rejected"], "chosen_key and rejected_key are the same field ('rejected')"),
    (["transport.bind_host=0.0.0.0"], "'0.0.0.0' listens on every interface of the node"),
    (["transport.bind_host=*"], "'*' listens on every interface of the node"),
    (["algorithm.kl.adaptive=true", "algorithm.kl.coef=0"],
     "algorithm.kl: adaptive needs a starting coef above 0: the controller multiplies the coefficient"),
    (["rollout.temperature=0.005"], "rollout.temperature is 0.005; vLLM samples at no less than 0.01 (it raises "
                                    "lower temperatures to it), transformers at 0.005, and the trainer scores"),
    (["eval.temperature=0.001"], "eval.temperature is 0.001; vLLM samples at no less than 0.01"),
])
def test_values_that_could_not_work_are_refused(tiny, tmp_path, overrides, expected):
    """Each of these passed validation and failed later, or silently: NaN and infinite settings, line
    breaks in #SBATCH values, environment names Popen refuses, a time limit shorter than the checkpoint
    warning, a TP size vLLM refuses, a pair of one field twice, an adaptive KL coefficient starting at 0 (which
    it multiplies), a group's CUDA_VISIBLE_DEVICES that the launcher replaced by GPUs 0, 1, ...), a temperature
    below 0.01 (vLLM sampled at 0.01, transformers and the trainer at the one given)."""
    assert expected in error_of(write_config(tmp_path, example("tiny-grpo.yaml", tiny)), overrides)


@pytest.mark.parametrize("example_name, overrides, expected, fixed", [
    ("tiny-grpo.yaml", ["eval.every_steps=2"],
     "eval.every_steps is 2, but data.eval_fraction is 0: no prompts are held out of training to evaluate on",
     ["data.eval_fraction=0.1"]),
    ("tiny-grpo.yaml", ["eval.every_steps=2", "data.eval_fraction=0.1", "eval.n=4"],
     "eval.n is 4 with eval.temperature 0 (greedy): every sample of a prompt would be the same",
     ["eval.temperature=0.7"]),
])
def test_an_evaluation_in_the_run_that_could_not_be_made_is_refused(tiny, tmp_path, example_name, overrides, expected,
                                                                    fixed):
    """Nothing held out to evaluate on; several greedy samples of a prompt (all the same). With the change of
    `fixed` the config loads."""
    config = write_config(tmp_path, example(example_name, tiny))
    assert expected in error_of(config, overrides)
    assert load_config(config, overrides + fixed).eval.every_steps == 2


def test_an_evaluation_in_the_run_needs_a_held_out_prompt(tiny, tmp_path):
    """A share held out of a few prompts may hold none of them: refused as the data is read, before the run
    directory or any process is made."""
    from toolkit.data.dataset import check_data

    few = tmp_path / "few.jsonl"
    few.write_text("".join(f'{{"prompt": "{k} 2 3"}}\n' for k in range(4)))
    config = write_config(tmp_path, example("tiny-grpo.yaml", tiny, data={"prompts": str(few), "eval_fraction": 0.01},
                                            eval={"every_steps": 2}, rollout={"prompts_per_step": 2},
                                            trainer={"micro_batch_size": 8}))
    with pytest.raises(ConfigError, match=re.escape("eval.every_steps: none of the run's prompts fell in the share "
                                                    "held out of training (data.eval_fraction 0.01)")):
        check_data(load_config(config))
    result = cli("run", config, "--run-dir", tmp_path / "run")
    assert result.returncode == 2 and "eval.every_steps: none of" in result.stderr
    assert not (tmp_path / "run").exists()


def test_an_evaluation_scored_by_ranks_that_generate_needs_a_held_out_prompt_for_each(tiny, tmp_path):
    """Flattening over 2 ranks with a reward model: each rank generates its share of an evaluation's
    prompts and then scores with the others (ZeRO-3 may shard the reward model over them), so a share
    held out of fewer prompts than ranks is refused as the data is read; on one rank it runs."""
    from toolkit.data.dataset import check_data

    few = tmp_path / "few.jsonl"
    few.write_text("".join(f'{{"prompt": "{k} 2 3"}}\n' for k in range(40)))
    data = example("tiny-ppo.yaml", tiny, data={"prompts": str(few), "eval_fraction": 0.05}, eval={"every_steps": 2},
                   placement={"strategy": "flattening", "all": {"workers": 2}})
    held_out = len(check_data(load_config(write_config(tmp_path, data), ["placement.all.workers=1"])).eval)
    assert held_out == 1
    with pytest.raises(ConfigError, match=re.escape("eval.every_steps: 1 prompt(s) fell in the share held out of "
                                                    "training (data.eval_fraction 0.05), fewer than the 2 trainer "
                                                    "ranks that generate them")):
        check_data(load_config(write_config(tmp_path, data)))


def test_files_that_are_not_what_they_should_be_are_named(tiny, tmp_path):
    """A config that is not UTF-8, a stage that is not a name, a model whose config.json is not a JSON
    object or not JSON: each once ended in a traceback."""
    binary = tmp_path / "bin.yaml"
    binary.write_bytes(b"\xff\xfeabc")
    assert f"{binary}: not UTF-8 text (byte 0: b'\\xff')" in error_of(binary)
    assert "stage: got ['rl']; one of rl, sft, rm" in error_of(write_config(tmp_path, {"stage": ["rl"]}, "s.yaml"))
    for name, text, says in [("list", "[1, 2]", "holds a JSON list, not the object of a model's settings"),
                             ("broken", "{broken", "is not a JSON file (Expecting property name")]:
        model = tmp_path / name
        shutil.copytree(tiny / "model", model)
        (model / "config.json").write_text(text)
        data = example("tiny-grpo.yaml", tiny)
        data["model"]["actor"] = str(model)
        assert f"{model}/config.json {says}" in error_of(write_config(tmp_path, data)), name


def test_chat_prompts_need_a_tokenizer_with_a_chat_template(tiny, tmp_path):
    """validate, plan and submit accepted chat prompts beside a tokenizer without a chat template; the
    generators failed at their first step (after start-up, or a wait in the queue), and plan in a traceback."""
    model = tmp_path / "nochat"
    shutil.copytree(tiny / "model", model)
    (model / "chat_template.jinja").unlink()
    chat = tmp_path / "chat.jsonl"
    chat.write_text('{"prompt": "1 2"}\n{"messages": [{"role": "user", "content": "count"}]}\n')
    data = example("tiny-grpo.yaml", tiny, data={"prompts": str(chat)}, rollout={"prompts_per_step": 4})
    data["model"]["actor"] = str(model)
    assert f"{chat}:2: a prompt of chat messages, and the tokenizer {model} has no chat template to render it " \
           "with" in (said := cli("validate", write_config(tmp_path, data)).stderr), said
    data["data"]["prompts"] = str(tiny / "prompts.jsonl")
    assert "data.chat_template: true, and the tokenizer" in cli(
        "validate", write_config(tmp_path, data), "--set", "data.chat_template=true").stderr
    assert cli("validate", write_config(tmp_path, data)).returncode == 0  # (text prompts: no template needed)
    data["model"]["actor"] = str(tiny / "model")
    data["data"]["prompts"] = str(chat)
    assert cli("validate", write_config(tmp_path, data)).returncode == 0


def test_chat_prompts_a_template_refuses_are_named_before_start_up(tiny, tmp_path):
    """A template that refuses some prompts (Gemma's and Mistral's: a system message, turns that do not
    alternate) passed validate; an sft stage failed at the step that drew such a row (step 5 of 5 here, after
    start-up) with `TemplateError: System role not supported`, naming no row. So did a reward model of another
    vocabulary without a chat template (the scorer renders the prompt with its tokenizer), at the first step."""
    from toolkit.data.dataset import check_data

    model = tmp_path / "gemma-like"
    shutil.copytree(tiny / "model", model)
    (model / "chat_template.jinja").write_text(
        "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
        "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<s>assistant: {% endif %}")
    user = [{"role": "user", "content": "count"}]
    chat = tmp_path / "chat.jsonl"
    system = [{"role": "system", "content": "be brief"}, *user]
    chat.write_text("".join(json.dumps(r) + "\n" for r in [{"prompt": user}, {"prompt": user}, {"prompt": system}]))
    data = example("tiny-grpo.yaml", tiny, data={"prompts": str(chat)}, rollout={"prompts_per_step": 4})
    data["model"]["actor"] = str(model)
    with pytest.raises(ConfigError, match=re.escape(
            f"{chat}:3: the chat template of the tokenizer {model} cannot render this prompt of messages (system, "
            "user): TemplateError: System role not supported; convert such rows")):
        check_data(load_config(write_config(tmp_path, data)))
    chat.write_text("".join(json.dumps(r) + "\n" for r in [{"prompt": user}, {"prompt": "text"}]))
    assert check_data(load_config(write_config(tmp_path, data))).train_rows == 2  # (the template takes these)
    # a reward model of another vocabulary renders the prompt with its own tokenizer: one without a chat
    # template failed the scorer at the first step (ValueError: ... has no chat template)
    rm = tmp_path / "other-vocabulary-rm"
    shutil.copytree(tiny / "reward_model", rm)
    (rm / "chat_template.jinja").unlink(missing_ok=True)
    tokenizer = json.loads((rm / "tokenizer.json").read_text())
    tokenizer["added_tokens"].append({"id": len(tokenizer["model"]["vocab"]) + len(tokenizer["added_tokens"]),
                                      "content": "<rm_only>", "single_word": False, "lstrip": False, "rstrip": False,
                                      "normalized": False, "special": True})
    (rm / "tokenizer.json").write_text(json.dumps(tokenizer))
    data["model"]["actor"] = str(tiny / "model")
    data["reward"] = {"models": [{"path": str(rm), "name": "rm"}]}
    with pytest.raises(ConfigError, match=re.escape(
            f"{chat}:1: a prompt of chat messages, and reward.models.0 has a vocabulary of its own (it renders the "
            f"prompt itself), and the tokenizer {rm} has no chat template")):
        check_data(load_config(write_config(tmp_path, data)))
    data["reward"]["models"][0]["path"] = str(tiny / "reward_model")  # (the actor's vocabulary: no rendering)
    assert check_data(load_config(write_config(tmp_path, data))).train_rows == 2


def test_no_reward(tiny, tmp_path):
    data = example("tiny-grpo.yaml", tiny, reward={"functions": []})
    assert "no reward" in error_of(write_config(tmp_path, data))


def test_invalid_yaml_names_line(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("run:\n  name: x\n  steps: [1, 2\n")
    assert f"{path}:4" in error_of(path) and "not valid YAML" in error_of(path)


def test_a_key_given_twice_is_refused_not_overwritten(tiny, tmp_path):
    """YAML keeps the last of two equal keys silently: a second `rollout:` section would drop the first's fields.
    Merge keys (<<: *anchor) still work, and a cluster file and a --set value are read the same way."""
    from toolkit.config.load import parse_yaml
    from toolkit.placement.cluster import load_cluster

    text = write_config(tmp_path, example("tiny-grpo.yaml", tiny)).read_text()
    first = next(i for i, line in enumerate(text.splitlines(), 1) if line == "rollout:")
    path = tmp_path / "twice.yaml"
    path.write_text(text + "rollout:\n  group_size: 8\n")
    assert f"{path}:{len(text.splitlines()) + 1}:1: not valid YAML: key 'rollout' is given twice (first on line " \
           f"{first}); keep one" in error_of(path)
    path.write_text(text.replace("  group_size: 4\n", "  group_size: 4\n  group_size: 2\n"))
    assert "key 'group_size' is given twice" in error_of(path)
    assert parse_yaml("a: &x {b: 1, c: 2}\nd: {<<: *x, b: 3}\n", "m.yaml") == {"a": {"b": 1, "c": 2},
                                                                           "d": {"b": 3, "c": 2}}
    assert error_of(write_config(tmp_path, example("tiny-grpo.yaml", tiny)),
                    ["reward.functions=[{function: a:b, function: c:d}]"]) == (
        "--set 'reward.functions=[{function: a:b, function: c:d}]': key 'function' is given twice (first on line "
        "1); keep one")
    clusters = tmp_path / "c.yaml"
    clusters.write_text("name: a\nname: b\n")
    with pytest.raises(ConfigError, match=f"{clusters}:2:1: not valid YAML: key 'name' is given twice"):
        load_cluster(clusters)
    for text, holds in (("", "nothing"), ("- 1\n", "list")):  # (it said ": Input should be a valid dictionary")
        clusters.write_text(text)
        with pytest.raises(ConfigError, match=f"{clusters}: not a cluster file: it holds {holds}, where a mapping"):
            load_cluster(clusters)


def test_a_set_on_an_aliased_section_changes_that_place_only(tiny, tmp_path):
    """YAML makes one object of an anchor and its aliases: `--set placement.generator.workers=2` changed the
    scorer's and the trainer's workers too (two trainer ranks nobody asked for), silently."""
    from toolkit.config.load import parse_yaml

    text = write_config(tmp_path, example("tiny-grpo.yaml", tiny)).read_text()
    path = tmp_path / "alias.yaml"
    path.write_text(text + "placement:\n  strategy: separation\n  generator: &one {workers: 1, env: {A: '1'}}\n"
                    "  scorer: *one\n  trainer: {<<: *one}\n")
    cfg = load_config(path, ["placement.generator.workers=2", "placement.scorer.env.A=\"4\""])
    p = cfg.placement
    assert (p.generator.workers, p.scorer.workers, p.trainer.workers) == (2, 1, 1)
    assert (p.generator.env, p.scorer.env, p.trainer.env) == ({"A": "1"}, {"A": "4"}, {"A": "1"})
    with pytest.raises(ConfigError, match="m.yaml: an alias .* a config cannot contain itself"):
        parse_yaml("a: &x [1, *x]\n", "m.yaml")


def test_overrides(tiny, tmp_path):
    path = write_config(tmp_path, example("tiny-grpo.yaml", tiny))
    cfg = load_config(path, ["rollout.group_size=8", "trainer.lr=2e-6", "reward.functions.0.weight=0.5",
                             "run.name=my run"])
    assert cfg.rollout.group_size == 8 and cfg.trainer.lr == 2e-6
    assert cfg.reward.functions[0].weight == 0.5 and cfg.run.name == "my run"
    msg = error_of(path, ["rollout.temprature=0.5"])
    assert "--set rollout.temprature=0.5: rollout.temprature: unknown key" in msg
    assert "--set rollout.temperature=0" in error_of(path, ["rollout.temperature=0"])
    with pytest.raises(ConfigError, match="expected KEY=VALUE"):
        load_config(path, ["rollout.group_size"])
    for name in ("", "..", "a/b"):  # (the run directory runs/<name>: '' was runs/ itself, '..' its parent)
        assert (f"run.name: got {name!r}: the name is the run directory runs/<name>: one directory name, not empty, "
                "without '/'") in error_of(path, [f"run.name={name}"])


def test_a_check_across_fields_is_labelled_by_the_field_given(tiny, tmp_path):
    """Such a check is raised for the whole config; its error was labelled with the file's first key (line 1
    or so), even when a --set had given the field, in a pipeline too."""
    from tests.conftest import EXAMPLES
    from toolkit.config.pipeline import load_pipeline

    path = write_config(tmp_path, example("tiny-grpo.yaml", tiny))
    msg = error_of(path, ["trainer.micro_batch_size=5"])
    assert "\n  --set trainer.micro_batch_size=5: a step has 64 samples" in msg
    data = example("tiny-grpo.yaml", tiny)
    data["rollout"]["group_size"] = 1
    path = write_config(tmp_path, data)
    line = next(i for i, text in enumerate(path.read_text().splitlines(), 1) if "group_size: 1" in text)
    assert f"\n  {path}:{line}: rollout.group_size is 1; GRPO needs" in error_of(path)
    with pytest.raises(ConfigError) as info:
        load_pipeline(EXAMPLES / "tiny-pipeline.yaml", ["rl.rollout.group_size=1"]).configs(tmp_path / "pipeline")
    assert "\n  --set rl.rollout.group_size=1: rl: rollout.group_size is 1" in str(info.value)
    with pytest.raises(ConfigError) as info:  # (a shared section's --set, for each stage)
        load_pipeline(EXAMPLES / "tiny-pipeline.yaml", ["data.eval_fraction=7"]).configs(tmp_path / "pipeline")
    assert "\n  --set data.eval_fraction=7: sft.data.eval_fraction: got 7" in str(info.value)


def test_an_error_a_set_made_names_the_set(tiny, tmp_path):
    """An error in a section that a --set wrote is blamed on the --set: the file's nearest line was blamed,
    unrelated (`--set rolout.group_size=8` gave the file's first key's line, `rollout.vlm.kv_cache_gb=1` the
    line of `rollout:`), as was a check across a section's fields that names the field the --set gave. A
    section's own error stays on its line when the --set is about another field; a node group's field is named
    in full (it was `placement: gen.models: ...`)."""
    data = example("tiny-grpo.yaml", tiny)
    data["trainer"]["offload_params"] = True
    path = write_config(tmp_path, data)
    lines = path.read_text().splitlines()
    trainer = lines.index("trainer:") + 1
    for overrides, says in [
            (["trainer.offload_params=false", "rolout.group_size=8"],
             "--set rolout.group_size=8: rolout: unknown key 'rolout'"),
            (["trainer.offload_params=false", "rollout.vlm.kv_cache_gb=1"],
             "--set rollout.vlm.kv_cache_gb=1: rollout.vlm: unknown key 'vlm'"),
            (["trainer.offload_params=false", "algorithm.kl.adaptive=true", "algorithm.kl.coef=0"],
             "--set algorithm.kl.adaptive=true: algorithm.kl: adaptive needs a starting coef above 0"),
            (["trainer.lr=0.1"], f"{path}:{trainer}: trainer: offload_params needs zero_stage 3")]:
        assert f"\n  {says}" in error_of(path, overrides), overrides
    data = example("tiny-ppo.yaml", tiny, placement={"strategy": "custom", "gen": {"workers": 1}})
    path = write_config(tmp_path, data)
    placement = path.read_text().splitlines().index("placement:") + 1
    assert f"\n  {path}:{placement}: placement.gen.models: list the models of this group" in error_of(path)


def test_a_set_of_a_stage_the_pipeline_lacks_is_refused(tiny, tmp_path):
    """`--set rm.train.lr=0.1` on a pipeline without an rm section added an rm stage, which then failed with
    `rm.model: missing`."""
    from tests.conftest import EXAMPLES
    from toolkit.config.pipeline import load_pipeline

    data = yaml.safe_load((EXAMPLES / "tiny-pipeline.yaml").read_text())
    del data["rm"]
    data["data"]["sources"][0]["path"] = str(tiny / "pipeline.jsonl")
    data["sft"]["model"]["base"] = str(tiny / "model")
    data["rl"]["reward"] = {"functions": [{"function": "toolkit.rewards.examples:digit_ratio"}]}
    path = write_config(tmp_path, data, "pipeline.yaml")
    with pytest.raises(ConfigError) as info:
        load_pipeline(path, ["rm.train.lr=0.1"])
    assert str(info.value) == (f"--set rm.train.lr=0.1: {path} has no rm stage (its stages: sft, rl); a --set "
                               "changes a stage the file gives: add an `rm:` section to the file to run it")
    assert len(load_pipeline(path, ["rl.trainer.lr=0.1"]).configs(tmp_path / "pipeline")) == 2


def test_a_seed_is_one_vllm_takes(tiny, tmp_path):
    """A seed below 0 or from 2**32 validated, and vLLM's set_random_seed (numpy's) refused it only after the
    workers had started: run.seed of an RL run and of a stage, and data.split.seed, are 0 to 2**32 - 1."""
    from tests.conftest import EXAMPLES
    from toolkit.config.pipeline import load_pipeline

    path = write_config(tmp_path, example("tiny-grpo.yaml", tiny))
    for expr, field in [("run.seed=-1", "run.seed: got -1"), ("run.seed=4294967296", "run.seed: got 4294967296"),
                        ("data.split={rl: 1, seed: -5}", "data.split.seed: got -5")]:
        assert f"--set {expr}: {field}: a seed is from 0 to 4294967295" in error_of(path, [expr])
    assert load_config(path, ["run.seed=4294967295"]).run.seed == 2**32 - 1
    for expr, field in [("sft.run.seed=-1", "sft.run.seed: got -1"),
                        ("data.split.seed=4294967296", "sft.data.split.seed: got 4294967296")]:
        with pytest.raises(ConfigError) as info:
            load_pipeline(EXAMPLES / "tiny-pipeline.yaml", [expr]).configs(tmp_path / "pipeline")
        assert f"--set {expr}: {field}: a seed is from 0 to 4294967295" in str(info.value), str(info.value)


def test_resolved_config_round_trips(tiny, tmp_path):
    cfg = load_config(write_config(tmp_path, example("tiny-ppo.yaml", tiny)))
    again = write_config(tmp_path / "again", yaml.safe_load(dump_config(cfg)))
    assert load_config(again) == cfg


def test_cli_exit_code_2_and_no_run_dir(tiny, tmp_path):
    data = example("tiny-grpo.yaml", tiny)
    data["rollout"]["group_size"] = 0
    path = write_config(tmp_path, data)
    run_dir = tmp_path / "run"
    result = cli("run", path, "--run-dir", run_dir, timeout=60)
    assert result.returncode == 2
    assert "rollout.group_size: got 0" in result.stderr and "Traceback" not in result.stderr
    assert not run_dir.exists()


def test_bad_prompt_line_is_a_config_error(tiny, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "a"}\n{"prompt": "b"\n')
    data = example("tiny-grpo.yaml", tiny, data={"prompts": str(prompts)})
    result = cli("run", write_config(tmp_path, data), "--run-dir", tmp_path / "run", timeout=60)
    assert result.returncode == 2
    assert f"{prompts}:2: not valid JSON" in result.stderr
    prompts.write_text('{"text": "a"}\n')
    result = cli("run", write_config(tmp_path, data), "--run-dir", tmp_path / "run2", timeout=60)
    assert result.returncode == 2 and f"{prompts}:1: no non-empty string field 'prompt'" in result.stderr


@pytest.mark.parametrize("trainer, model, placement, expected", [
    ({"zero_stage": 0, "offload_optimizer": True}, {}, {}, "offload_optimizer needs zero_stage 1, 2 or 3"),
    ({"zero_stage": 2, "offload_params": True}, {}, {}, "offload_params needs zero_stage 3"),
    ({"zero_stage": 3, "lora": {"rank": 4}}, {}, {}, "lora with zero_stage 3 is not supported"),
    ({"lora": {"rank": 0}}, {}, {}, "trainer.lora.rank"),
    ({"lora": {"dropout": 0.05}}, {}, {}, "trainer.lora.dropout is 0.05, but RL trains with dropout off"),
    ({"lora": {}}, {"reference": "OTHER"}, {}, "model.reference: with trainer.lora the reference model is the actor"),
    ({"lora": {}}, {}, {"strategy": "colocate_critic_reward"}, "node group 'reference' of placement.strategy"),
    ({}, {"attn_implementation": "flash_attention_2"}, {}, "flash_attention_2 needs the flash-attn package"),
    ({}, {"attn_implementation": "fast"}, {}, "'sdpa', 'eager' or 'flash_attention_2'"),
    ({"micro_batch_tokens": 40}, {}, {}, "trainer.micro_batch_tokens is 40, less than one sample can have"),
    ({}, {"dtype": "float16"}, {}, "model.dtype is float16, but placement.trainer trains on CPUs"),
])
def test_memory_switch_errors_name_the_field_and_the_fix(tiny, tmp_path, trainer, model, placement, expected):
    data = example("tiny-grpo.yaml", tiny)
    data["trainer"].update(trainer)
    data["model"].update({k: (str(tiny / "reward_model") if v == "OTHER" else v) for k, v in model.items()})
    data.setdefault("placement", {}).update(placement)
    assert expected in error_of(write_config(tmp_path, data))


def test_packing_a_model_of_a_family_not_checked_packed_is_refused(tiny, tmp_path):
    """A hybrid model's state-space or convolution layers run across the packed samples' bounds (a reviewer's
    tiny Jamba, LFM2 and Qwen3-Next scored a sample by the one packed before it), silently: refused, for the
    actor or any model the run packs (here a reward model; in sft, the base model)."""
    other = tmp_path / "hybrid"
    shutil.copytree(tiny / "reward_model", other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "model_type": "jamba"}))
    data = example("tiny-ppo.yaml", tiny)
    data["model"]["packing"] = True
    data["reward"]["models"][0]["path"] = str(other)
    said = error_of(write_config(tmp_path, data))
    assert "model.packing: reward.models.0.path is a 'jamba' model, not of a family whose packed passes" in said
    assert "set model.packing: false" in said
    data["reward"]["models"][0]["path"] = str(tiny / "reward_model")
    assert load_config(write_config(tmp_path, data)).model.packing  # (a Llama: packed)


def test_a_critic_or_reference_that_cannot_read_the_actors_token_ids_is_refused(tiny, tmp_path):
    """The critic and the reference model read the actor's token ids as they are: one with fewer token
    embeddings failed the run at its first step (index out of range), one with a tokenizer of other ids
    scored other tokens, silently."""
    import shutil

    small = tmp_path / "small"
    shutil.copytree(tiny / "reward_model", small)
    config = json.loads((small / "config.json").read_text())
    (small / "config.json").write_text(json.dumps({**config, "vocab_size": 300}))
    data = example("tiny-ppo.yaml", tiny)
    data["model"]["critic"] = str(small)
    said = error_of(write_config(tmp_path, data))
    assert f"model.critic: {small} has 300 token embeddings (vocab_size), fewer than the 512 ids" in said, said
    other = tmp_path / "other"
    shutil.copytree(tiny / "model", other)
    tokenizer = json.loads((other / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    a, b = list(vocab)[10:12]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # (two tokens' ids swapped)
    (other / "tokenizer.json").write_text(json.dumps(tokenizer))
    data = example("tiny-grpo.yaml", tiny)
    data["model"]["reference"] = str(other)
    said = error_of(write_config(tmp_path, data))
    assert f"model.reference: {other} has a tokenizer of its own that gives 2 token(s) other ids" in said, said
    data = example("tiny-ppo.yaml", tiny)
    data["model"]["critic"] = str(tiny / "reward_model")  # (trained with the actor's tokenizer)
    assert load_config(write_config(tmp_path, data)).model.critic


def test_packing_with_ptx_is_refused(tiny, tmp_path):
    text = {"sources": [{"path": str(tiny / "pipeline.jsonl")}], "text_key": "response"}
    data = example("tiny-grpo.yaml", tiny, ptx={"coef": 1.0, "data": text})
    data["model"]["packing"] = True
    assert "model.packing with ptx.coef > 0 is not supported" in error_of(write_config(tmp_path, data))


@pytest.mark.parametrize("settings, expected", [
    ({"model": {"critic": "ACTOR"}}, "model.critic is set, but run.algorithm grpo has no critic"),
    ({"model": {"packing": True, "attn_implementation": "eager"}},
     "model.attn_implementation eager would not be used; set model.packing: false"),
    ({"rollout": {"backend": "hf", "vllm": {"tensor_parallel_size": 2}}},
     "rollout.vllm.tensor_parallel_size is 2, but generation does not use vLLM (rollout.backend is 'hf')"),
    ({"placement": {"strategy": "flattening"}, "rollout": {"backend": "hf", "vllm": {"tensor_parallel_size": 2}}},
     "rollout.vllm.tensor_parallel_size is 2, but generation does not use vLLM (rollout.backend is 'hf')"),
    ({"rollout": {"stale": "drop"}}, "rollout.stale is 'drop', which acts only in asynchronous mode"),
])
def test_a_setting_that_would_be_ignored_is_refused(tiny, tmp_path, settings, expected):
    """Each of these ran before, the setting silently without effect."""
    data = example("tiny-grpo.yaml", tiny)
    for section, values in settings.items():
        values = {k: (str(tiny / "model") if v == "ACTOR" else v) for k, v in values.items()}
        data.setdefault(section, {}).update(values)
    assert expected in error_of(write_config(tmp_path, data))


@pytest.mark.parametrize("ptx_data, expected", [
    ({"split": {"rl": 1}}, "ptx.data.split: the PTX text is a corpus of its own"),
    ({"eval_fraction": 0.1}, "ptx.data.eval_fraction: nothing evaluates the PTX text"),
    ({"prompts": "TEXT"}, "ptx.data: give prompts or sources, not both"),
])
def test_ptx_data_is_one_corpus_named_as_ptx_data(tiny, tmp_path, ptx_data, expected):
    """ptx.data.split once crashed the validation with a KeyError, and the data section's own errors said
    `data.` where they were about ptx.data."""
    text = {"sources": [{"path": str(tiny / "pipeline.jsonl")}], "text_key": "response"}
    ptx_data = {k: (str(tiny / "pipeline.jsonl") if v == "TEXT" else v) for k, v in ptx_data.items()}
    data = example("tiny-grpo.yaml", tiny, ptx={"coef": 1.0, "data": {**text, **ptx_data}})
    assert expected in error_of(write_config(tmp_path, data))


def test_a_ptx_row_without_text_names_ptx_data_text_key(tiny, tmp_path):
    """A PTX row without its text field said `set data.text_key`, a setting of the RL prompts' section that the
    PTX text does not read; it names ptx.data.text_key."""
    from toolkit.data.dataset import check_data

    for rows, says in [([{"prompt": "a"}], "no non-empty string field 'text' (fields: ['prompt']); set "
                         "ptx.data.text_key to the field holding the text"),
                       ([{"text": 3}], "field 'text' is 3 (int), not non-empty text; fix the row, or set "
                        "ptx.data.text_key to the field holding the text")]:
        (tmp_path / "p.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
        data = example("tiny-grpo.yaml", tiny, ptx={"coef": 1.0, "data": {"prompts": "p.jsonl"}})
        cfg = load_config(write_config(tmp_path, data))
        with pytest.raises(ConfigError) as info:
            check_data(cfg)
        assert f"{tmp_path / 'p.jsonl'}:1: {says}" == str(info.value)


def test_lora_targets_that_are_no_layer_say_what_they_are(tiny, tmp_path):
    """A module without a weight matrix is named by its kind: `self_attn` was refused with "a norm's weight is
    a vector", but it holds layers; and a value of neither kind of target_modules is one line (it was two, one
    per kind of pydantic's union: `target_modules.list[str].0` and `target_modules.literal['all-linear']`)."""
    data = example("tiny-grpo.yaml", tiny, trainer={"lora": {"target_modules": ["q_proj"]}})
    path = write_config(tmp_path, data)
    field = "trainer.lora.target_modules"
    for targets, says in [
            ("[self_attn]", "self_attn holds layers but is no layer itself (name the layers in it: k_proj, o_proj, "
                            "q_proj, v_proj), so it would get no adapter"),
            ("[q_proj, mlp]", "mlp holds layers but is no layer itself (name the layers in it: down_proj, gate_proj, "
                              "up_proj), so it would get no adapter"),
            ("[rotary_emb]", "rotary_emb has no weights (LoRA adapts a layer's weight matrix), so it would get no "
                             "adapter"),
            ("[input_layernorm]", "input_layernorm has no weight matrix (a norm's weight is a vector, which LoRA "
                                  "cannot adapt), so it would get no adapter"),
            ("[0]", "item 0 is 0, not a layer name; give names (e.g. [q_proj, v_proj]), or all-linear"),
            ("[q_proj, 7]", "item 1 is 7, not a layer name"),
            ("q_proj", "got 'q_proj': a list of layer names goes here, even for one: [q_proj]; or all-linear"),
            ("5", "got 5: give a list of layer names (e.g. [q_proj, v_proj]), or all-linear")]:
        msg = error_of(path, [f"{field}={targets}"])
        assert msg.startswith(f"invalid config:\n  --set {field}={targets}: {field}: {says}") and \
            msg.count("\n") == 1, msg
    assert load_config(path, [f"{field}=all-linear"]).trainer.lora.target_modules == "all-linear"


def test_lora_targets_that_name_no_layer_are_refused(tiny, tmp_path):
    """peft refuses a target list of which no name matches, but skips a typo beside a good name silently:
    the adapters went on fewer layers than asked. The names are looked up in the safetensors headers (one
    file, or a sharded checkpoint's index), then in the model as transformers builds it, in RL and SFT
    configs."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    sharded = tmp_path / "sharded"
    model = AutoModelForCausalLM.from_pretrained(tiny / "model", dtype=torch.float32)
    model.save_pretrained(sharded, max_shard_size="200KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    for actor in (tiny / "model", sharded):
        data = example("tiny-grpo.yaml", tiny, trainer={"lora": {"target_modules": ["q_proj", "v_prj"]}})
        data["model"].update(actor=str(actor), tokenizer=str(tiny / "model"))
        msg = error_of(write_config(tmp_path, data))
        assert f"trainer.lora.target_modules: v_prj is not a layer of {actor}, so it would get no adapter; its " \
               "layers with a weight matrix end in down_proj, embed_tokens, gate_proj, k_proj, lm_head, o_proj, " \
               "q_proj, up_proj, v_proj (or use all-linear)" in msg, msg
        data["trainer"]["lora"]["target_modules"] = ["q_proj", "mlp.up_proj", "model.layers.1.self_attn.v_proj"]
        assert load_config(write_config(tmp_path, data)).trainer.lora.target_modules[0] == "q_proj"
        # a layer without a weight matrix (peft refused it at start-up), and no layer at all
        data["trainer"]["lora"]["target_modules"] = ["q_proj", "input_layernorm"]
        assert "trainer.lora.target_modules: input_layernorm has no weight matrix (a norm's weight is a vector, " \
               "which LoRA cannot adapt), so it would get no adapter" in error_of(write_config(tmp_path, data))
        data["trainer"]["lora"]["target_modules"] = ["v_prj", "norm"]
        assert f"v_prj is not a layer of {actor}; norm has no weight matrix (a norm's weight is a vector, which " \
               "LoRA cannot adapt), so they would get no adapter" in error_of(write_config(tmp_path, data))
        data["trainer"]["lora"]["target_modules"] = []
        assert "trainer.lora.target_modules: an empty list gives no layer an adapter" in error_of(
            write_config(tmp_path, data))
    sft = {"stage": "sft", "run": {"steps": 2}, "data": {"sources": [{"path": str(tiny / "pipeline.jsonl")}]},
           "model": {"base": str(tiny / "model")}, "train": {"lora": {"target_modules": ["qproj"]}}}
    assert "train.lora.target_modules: qproj is not a layer" in error_of(write_config(tmp_path, sft, "sft.yaml"))
    # a tied output head is not in the checkpoint, but peft puts an adapter on it: the model as built has it
    tied = tmp_path / "tied"
    config = AutoConfig.from_pretrained(tiny / "model")
    config.tie_word_embeddings = True
    AutoModelForCausalLM.from_config(config).save_pretrained(tied)
    from safetensors import safe_open

    with safe_open(tied / "model.safetensors", "pt") as f:
        assert not any(k.startswith("lm_head") for k in f.keys())
    data = example("tiny-grpo.yaml", tiny, trainer={"lora": {"target_modules": ["q_proj", "lm_head"]}})
    data["model"].update(actor=str(tied), tokenizer=str(tiny / "model"))
    assert "trainer.lora.target_modules: lm_head is the input embedding or output head of" in error_of(
        write_config(tmp_path, data))  # (found, but tied: test_lora_on_a_tied_embedding_or_head_is_refused)


def test_lora_on_a_tied_embedding_or_head_is_refused(tiny, tmp_path):
    """A model whose embedding and output head share one weight cannot hold an adapter on either once merged,
    which is what vLLM and the exports get: with one on GPT-2's head the generator's log-probs differed from
    the trainer's by up to 105 (the update never left the trainer), with one on its embedding by 385 (merged
    into the head too). Both are refused by name, in RL and SFT; the same names on an untied model are not."""
    from toolkit.tiny import build_family

    gpt2 = build_family(REPO / "models" / "tiny-gpt2-tied", "gpt2-tied")
    for targets, hit in [(["c_attn", "lm_head"], "lm_head is"), (["wte"], "wte is"),
                         (["transformer.wte", "lm_head"], "transformer.wte, lm_head are")]:
        data = example("tiny-grpo.yaml", tiny, model={"actor": str(gpt2)},
                       trainer={"lora": {"target_modules": targets}})
        msg = error_of(write_config(tmp_path, data))
        assert f"trainer.lora.target_modules: {hit} the input embedding or output head of {gpt2}, which share one " \
               "weight (tie_word_embeddings): an adapter there unties them" in msg, msg
    sft = {"stage": "sft", "run": {"steps": 2}, "data": {"sources": [{"path": str(tiny / "pipeline.jsonl")}]},
           "model": {"base": str(gpt2)}, "train": {"lora": {"target_modules": ["lm_head"]}}}
    assert "train.lora.target_modules: lm_head is the input embedding" in error_of(
        write_config(tmp_path, sft, "sft.yaml"))
    data = example("tiny-grpo.yaml", tiny, model={"actor": str(gpt2)}, trainer={"lora": {"target_modules": ["c_attn"]}})
    assert load_config(write_config(tmp_path, data)).trainer.lora.target_modules == ["c_attn"]
    untied = example("tiny-grpo.yaml", tiny,
                     trainer={"lora": {"target_modules": ["q_proj", "lm_head", "embed_tokens"]}})
    assert load_config(write_config(tmp_path, untied)).trainer.lora.target_modules[1] == "lm_head"


def test_lora_moves_the_reference_into_the_trainer(tiny, tmp_path):
    from toolkit.placement.plan import plan, stages

    cfg = load_config(write_config(tmp_path, example("tiny-grpo.yaml", tiny, trainer={"lora": {"rank": 4}})))
    groups = {g.name: g.roles for g in plan(cfg)}
    assert groups == {"generator": ("generator",), "scorer": ("reward",), "trainer": ("trainer",)}
    assert stages(plan(cfg)) == ("generator", "reward", "trainer")
    assert cfg.trainer.lora.target_modules == "all-linear" and cfg.trainer.lora.alpha == 16


def test_stage_config_errors(tiny, tmp_path):
    base = {"run": {"steps": 2}, "data": {"sources": [{"path": str(tiny / "pipeline.jsonl")}]},
            "model": {"base": str(tiny / "model")}}
    rm = write_config(tmp_path, {"stage": "rm", **base, "train": {"lora": {"rank": 4}}}, "rm.yaml")
    assert "train.lora is for causal LMs" in error_of(rm)
    rm = write_config(tmp_path, {"stage": "rm", **base, "train": {"packing": True}}, "rm-packed.yaml")
    assert "train.packing is for the sft stage" in error_of(rm)
    packed = write_config(tmp_path, {"stage": "sft", **base, "train": {"packing": True},
                                     "model": {**base["model"], "attn_implementation": "flash_attention_2"}}, "p.yaml")
    assert "flash_attention_2" in error_of(packed)
    packed = write_config(tmp_path, {"stage": "sft", **base, "train": {"packing": True},
                                     "model": {**base["model"], "attn_implementation": "eager"}}, "e.yaml")
    assert "model.attn_implementation eager would not be used" in error_of(packed)
    fp16 = write_config(tmp_path, {"stage": "sft", **base, "model": {**base["model"], "dtype": "float16"}}, "f.yaml")
    assert "model.dtype is float16, but placement.trainer trains on CPUs (gpus_per_worker 0)" in error_of(fp16)
    # (a stage has one node group: same_nodes_as crashed the allocation's planning, and slurm.nodes went unchecked)
    shared = write_config(tmp_path, {"stage": "sft", **base, "placement": {"trainer": {"same_nodes_as": "x"}}}, "n.yaml")
    assert "placement.trainer.same_nodes_as is 'x', but the sft stage has one node group" in error_of(shared)
    wide = write_config(tmp_path, {"stage": "rm", **base, "placement": {"trainer": {"nodes": 3, "workers": 3}},
                                   "train": {"batch_size": 24}, "slurm": {"nodes": 2}}, "w.yaml")
    assert "placement.trainer.nodes is 3 but slurm.nodes allows 2" in error_of(wide)
    on_gpus = {"stage": "sft", **base, "model": {**base["model"], "dtype": "float16"},
               "placement": {"trainer": {"gpus_per_worker": 1}}}
    assert load_config(write_config(tmp_path, on_gpus, "g.yaml")).model.dtype == "float16"


@pytest.mark.parametrize("stage", ["sft", "rm"])
def test_an_rl_config_given_to_a_stage_command_is_named_as_one(tiny, tmp_path, stage):
    """`slurm-rlhf sft run.yaml` of an RL config (no `stage:` key) validated it as an sft config: seven errors, each
    saying to remove one of its sections (`rollout: unknown key 'rollout'`), none that it was the wrong command."""
    rl = write_config(tmp_path, example("tiny-grpo.yaml", tiny))
    result = cli(stage, rl, "--run-dir", tmp_path / "run", timeout=60)
    assert result.returncode == 2 and not (tmp_path / "run").exists(), result.stderr
    assert result.stderr.count("error") == 1, result.stderr
    assert (f"this is an 'rl' config (no `stage:` key, and rollout, reward, algorithm, trainer, which only RL runs "
            f"have); this command runs {stage!r} configs: run this one with `slurm-rlhf run`") in result.stderr
    # a stage config without its `stage:` key is still the command's stage, and `run` (rl) names the key it lacks
    base = {"run": {"steps": 2}, "data": {"sources": [{"path": str(tiny / "pipeline.jsonl")}]},
            "model": {"base": str(tiny / "model")}, "train": {"lr": 1e-3}}
    unstaged = write_config(tmp_path, base, "s.yaml")
    assert load_config(unstaged, stage=stage).stage == stage
    assert error_of(unstaged) == (f"{unstaged}: no `stage:` key, so this is an 'rl' config, but it has train, which "
                                  "only sft and rm stages have; add `stage: sft` or `stage: rm` to it (or run it "
                                  "with `slurm-rlhf sft` or `slurm-rlhf rm`)")


def _model_with(tmp_path, tiny, name: str, **config) -> str:
    """A copy of the tiny model's config.json with `config` changed, and its tokenizer (enough for validation)."""
    import json

    from toolkit.tiny import copy_tokenizer

    model = tmp_path / name
    model.mkdir()
    tiny_config = json.loads((tiny / "model" / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**tiny_config, **config}))
    copy_tokenizer(tiny / "model", model)
    return str(model)


def test_samples_longer_than_a_model_takes_are_a_config_error(tiny, tmp_path):
    """vLLM refuses a context over the model's positions only once its worker has started (and learned
    positions fail in the trainer): validation says it first, for every model that reads whole samples."""
    path = write_config(tmp_path, example("tiny-grpo.yaml", tiny))  # 256 prompt + 24 new tokens
    assert load_config(path, ["rollout.max_new_tokens=256"]).rollout.max_new_tokens == 256  # 512: exactly fits
    msg = error_of(path, ["rollout.max_new_tokens=257"])
    assert "model.actor takes at most 512 tokens (max_position_embeddings 512 in " in msg
    assert "rollout.max_prompt_tokens + max_new_tokens allow 513; lower them to 512 in all" in msg
    short = _model_with(tmp_path, tiny, "short", max_position_embeddings=200)
    for field, section in [("model.reference", {"model": {"reference": short}}),
                           ("reward.models.0.path", {"reward": {"models": [{"path": short}]}})]:
        msg = error_of(write_config(tmp_path, example("tiny-grpo.yaml", tiny, **section)))
        assert f"{field} takes at most 200 tokens" in msg and "allow 280" in msg
    # GPT-2's name for it; a linear RoPE scaling multiplies it (4 x 100 = 400 >= 280)
    gpt2 = _model_with(tmp_path, tiny, "gpt2-named", max_position_embeddings=None, n_positions=100)
    gpt2_config = write_config(tmp_path, example("tiny-grpo.yaml", tiny, model={"actor": gpt2}))
    assert "(n_positions 100 in " in error_of(gpt2_config)
    scaled = _model_with(tmp_path, tiny, "scaled", max_position_embeddings=100,
                         rope_scaling={"rope_type": "linear", "factor": 4.0})
    load_config(write_config(tmp_path, example("tiny-grpo.yaml", tiny, model={"actor": scaled},
                                               rollout={"backend": "hf"})))
    ptx = {"coef": 1.0, "max_tokens": 600, "data": {"sources": [{"path": str(tiny / "pipeline.jsonl")}]}}
    ptx_config = write_config(tmp_path, example("tiny-grpo.yaml", tiny, ptx=ptx))
    assert "model.actor takes at most 512 tokens" in error_of(ptx_config)
    stage = {"stage": "sft", "run": {"steps": 2}, "data": {"sources": [{"path": str(tiny / "pipeline.jsonl")}]},
             "model": {"base": str(tiny / "model")}, "train": {"max_tokens": 1024}}
    msg = error_of(write_config(tmp_path, stage, "sft.yaml"))
    assert "model.base takes at most 512 tokens" in msg and "train.max_tokens allow 1024" in msg
    # In a pipeline, a stage's export is not written yet when the file is validated: the model it starts from
    # stands in (the RL stage would otherwise fail only after the SFT and reward model stages had run).
    from tests.conftest import EXAMPLES
    from toolkit.config.pipeline import load_pipeline

    for overrides, field in [([f"sft.model.base={short}"], "rl: model.actor"),
                             ([f"sft.model.base={short}", f"rl.model.actor={tiny / 'model'}"],
                              "rl: reward.models.0.path")]:  # (rm: from sft, from `short`)
        with pytest.raises(ConfigError) as info:
            load_pipeline(EXAMPLES / "tiny-pipeline.yaml", overrides).configs(tmp_path / "pipeline")
        assert f"{field} takes at most 200 tokens (max_position_embeddings 200 in {short}/config.json)" in str(
            info.value) and "allow 280" in str(info.value), str(info.value)
    assert len(load_pipeline(EXAMPLES / "tiny-pipeline.yaml").configs(tmp_path / "pipeline")) == 3


@pytest.mark.parametrize("overrides,expected", [
    (["pipeline.stages=[rl]"], "pipeline: unknown key(s) stages; it has only `name`"),
    (["dpo={}"], "unknown section(s) dpo; a pipeline file has pipeline, data, slurm and the stages sft, rm, rl"),
    (["sft=[1]"], "sft: expected the stage's config (a mapping)"),
    (["sft.stage=sft"], "sft.stage: not needed in a pipeline"),
    (["rm.model.base=rl"], "rm.model.base: 'rl' names a stage that does not come before rm in this pipeline"),
    (["pipeline.name=../x"], "pipeline.name: got '../x'; the name is the run directory runs/<name>"),
    (["rl.data.split={rl: 1}"], "rl.data.split: a pipeline splits its rows once for every stage"),
    (["sft.run=null"], "sft.run: expected the stage's run settings (a mapping), got None"),
])
def test_pipeline_file_errors_name_the_section(tmp_path, overrides, expected):
    from tests.conftest import EXAMPLES
    from toolkit.config.pipeline import load_pipeline

    with pytest.raises(ConfigError, match=re.escape(f"tiny-pipeline.yaml: {expected}")):
        load_pipeline(EXAMPLES / "tiny-pipeline.yaml", overrides).configs(tmp_path / "pipeline")


@pytest.mark.parametrize("given", ["rl.data.prompts={path}", "rl.data.sources=[{{path: {path}}}]"])
def test_a_pipeline_stages_own_prompts_are_all_its_own(tiny, tmp_path, given):
    """An RL stage with a prompt file of its own: the shared split (rl: 40%) dropped 67 of its 100 prompts,
    silently, and `prompts:` beside the shared `sources` was an error. Its own file, which no other stage
    reads, is its whole (part rl); a file another stage reads too stays split."""
    from tests.conftest import EXAMPLES
    from toolkit.config.pipeline import load_pipeline
    from toolkit.data.dataset import StageData

    own = tmp_path / "prompts.jsonl"
    own.write_text("".join(json.dumps({"prompt": f"my prompt {i}"}) + "\n" for i in range(100)))
    rl = load_pipeline(EXAMPLES / "tiny-pipeline.yaml", [given.format(path=own)]).configs(tmp_path / "p")[-1]
    assert [(s.path, s.part) for s in rl.data.sources] == [(str(own), "rl")]
    data = StageData(rl.data, "rl", "prompt", 1)
    assert data.train_rows + len(data.eval) == 100 and 0 < len(data.eval) < 20  # (eval_fraction 0.1)
    shared = tiny / "pipeline.jsonl"
    both = load_pipeline(EXAMPLES / "tiny-pipeline.yaml", [f"rl.data.sources=[{{path: {own}}}, {{path: {shared}}}]"]
                         ).configs(tmp_path / "p")[-1]
    assert [s.part for s in both.data.sources] == ["rl", None]  # (the sft and rm stages read the shared file)


def test_an_error_in_a_pipelines_shared_section_names_its_line(tiny, tmp_path):
    """The shared data section is checked as part of each stage's config: its errors pointed at the stage's
    first line (`sft:`), not at the shared line that was wrong."""
    from tests.conftest import EXAMPLES
    from toolkit.config.pipeline import load_pipeline

    text = (EXAMPLES / "tiny-pipeline.yaml").read_text().replace("../../models", str(tiny.parent))
    for old, new, wrong in [("eval_fraction: 0.1", "eval_fraction: 2", "eval_fraction: 2"),
                            ("pipeline.jsonl\n", "pipeline.jsonl\n      weight: -1\n", "weight: -1")]:
        path = tmp_path / "p.yaml"
        path.write_text(text.replace(old, new))
        with pytest.raises(ConfigError) as info:
            load_pipeline(path).configs(tmp_path / "p")
        line = next(i for i, t in enumerate(path.read_text().splitlines(), 1) if wrong in t)
        assert f"p.yaml:{line}: sft.data." in str(info.value), (line, str(info.value))


def test_a_pipelines_bad_row_names_the_stage_that_reads_it(tiny, tmp_path):
    """Every stage reads the shared file: a row the rm stage cannot read (no pair) names that stage."""
    from tests.conftest import EXAMPLES

    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"p{i}", "response": "r"}) + "\n" for i in range(200)))
    result = cli("run", EXAMPLES / "tiny-pipeline.yaml", "--run-dir", tmp_path / "p", "--set",
                 f"data.sources=[{{path: {rows}}}]")
    assert result.returncode == 2 and "error: stage rm: " in result.stderr and "'chosen'" in result.stderr, \
        result.stderr


def test_validate_says_what_the_auto_settings_come_to_here(tiny, tmp_path):
    """`validate` prints the config resolved; the `auto` choices (vLLM or transformers, the allocator) are
    resolved only where the run starts, so it names what they come to on this machine, as YAML comments: the
    output still loads as the same config."""
    from toolkit.launch import mkl_amd
    from toolkit.launch.allocator import choice

    path = write_config(tmp_path, example("tiny-grpo.yaml", tiny))
    result = cli("validate", path, "--set", "placement.strategy=flattening")
    assert result.returncode == 0, result.stderr
    assert yaml.safe_load(result.stdout)["rollout"]["backend"] == "auto"
    comments = [line for line in result.stdout.splitlines() if line.startswith("#")]
    allocator = choice("auto")[0]
    assert comments[0] == "# rollout.backend auto: vllm here (vLLM is installed)"
    assert comments[1].startswith(f"# run.allocator auto: {allocator} on this machine"), comments
    library, why = mkl_amd.library()
    assert comments[2] == ("# run.fast_mkl_on_amd: "
                           + (f"MKL's library {library}" if library else f"no effect here ({why})"))
    result = cli("validate", path, "--set", "rollout.backend=hf", "--set", "run.allocator=system",
                 "--set", "run.fast_mkl_on_amd=false")
    assert result.returncode == 0 and not any(line.startswith("#") for line in result.stdout.splitlines())
    # run.openmp_spin, and the environment's own GOMP_SPINCOUNT that wins over it
    spin = cli("validate", path, "--set", "rollout.backend=hf", "--set", "run.openmp_spin=3000")
    environment = os.environ.get("GOMP_SPINCOUNT")
    assert spin.returncode == 0 and spin.stdout.splitlines()[-1] == (
        f"# run.openmp_spin 3000: GOMP_SPINCOUNT={environment} in this environment wins (the workers inherit it)"
        if environment else "# run.openmp_spin: the workers' OpenMP threads spin 3000 times before they sleep "
        "(GOMP_SPINCOUNT)"), spin.stdout
    ours = cli("validate", path, "--set", "rollout.backend=hf", "--set", "run.openmp_spin=3000",
               env={"GOMP_SPINCOUNT": "100"})
    assert ours.returncode == 0 and ours.stdout.splitlines()[-1] == (
        "# run.openmp_spin 3000: GOMP_SPINCOUNT=100 in this environment wins (the workers inherit it)"), ours.stdout


def test_a_time_limit_in_slurms_formats_is_taken_in_minutes(tiny, tmp_path):
    """`slurm.time_min: "2:00:00"` was refused as "not a valid integer", which did not say the unit."""
    for given, minutes in [("2:00:00", 120), ("90:30", 91), ("1-12", 2160), ("1-0:0:1", 1441), ("45", 45), (30, 30)]:
        cfg = load_config(write_config(tmp_path / str(minutes), example("tiny-grpo.yaml", tiny,
                                                                        slurm={"time_min": given})))
        assert cfg.slurm.time_min == minutes, given
    with pytest.raises(ConfigError, match=r"slurm.time_min: '2h' is not a time limit; write minutes \(e.g. 120\)"):
        load_config(write_config(tmp_path / "h", example("tiny-grpo.yaml", tiny, slurm={"time_min": "2h"})))
