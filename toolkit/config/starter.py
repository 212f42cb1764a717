"""`slurm-rlhf init --model PATH [--cluster FILE]`: a commented starter config for a model, sized by the
planner for a cluster, that validates as written.

Without --prompts, a few example prompts are written beside the config (replace them with yours); without
--reward-model, a placeholder rule-based reward is used. The planner's best plan (placement, ZeRO stage,
micro-batch, vLLM tensor parallelism) goes in when a cluster file is given; otherwise the config runs
here with one worker per node group.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from pathlib import Path

from toolkit.config.model_files import context_limit, head_problem, tokenizer_problem
from toolkit.errors import ConfigError

EXAMPLE_PROMPTS = ["Explain what a Slurm job step is in two sentences.",
                   "Write a haiku about a cluster at night.",
                   "What is 17 times 23? Answer with the number.",
                   "Give three tips for writing clear code.",
                   "Summarise the idea of reinforcement learning from human feedback.",
                   "Name a prime number larger than 100.",
                   "Describe a shared file system to a new user.",
                   "Translate 'good morning' into French."]


def _shape(model: Path, cluster_file: str | None):
    """(the model's shape as the planner counts it, None), or (None, why it cannot) for a family it does not
    count (then the config is written for this machine with settings safe at any size, and a cluster needs
    `plan --params`)."""
    from toolkit.placement.cost import ModelShape
    from toolkit.placement.shapes import NotCounted

    try:
        return ModelShape.from_config(str(model)), None
    except ConfigError as e:
        what = e.what if isinstance(e, NotCounted) else str(e)
        if cluster_file is None:
            return None, what
        raise ConfigError(f"{what}, so init cannot size a config for {cluster_file}; "
                          f"write one for this machine (init without --cluster), then plan it for the cluster with "
                          f"the model's size: slurm-rlhf plan CONFIG --cluster {cluster_file} --params actor=7e9 "
                          "--write PLANNED.yaml") from None


def kv_cache_gb(shape, data: dict, sequences: int = 16) -> float | None:
    """vLLM's KV cache for `sequences` samples of the longest length at once, in steps of 0.5 GiB; None where
    the default (0.5 GiB) holds them, or the shape is not known. The default held not even one sample of
    a 13B model, so the config `init` wrote failed its own check."""
    from toolkit.config.schema import RolloutSection
    from toolkit.placement.cost import DTYPE_BYTES

    if shape is None:
        return None
    rollout = data["rollout"]
    tokens = rollout.get("max_prompt_tokens", RolloutSection.model_fields["max_prompt_tokens"].default) + \
        rollout["max_new_tokens"]
    need = min(sequences, rollout["prompts_per_step"] * rollout["group_size"]) * tokens * shape.kv_bytes_per_token(
        DTYPE_BYTES[data["model"]["dtype"]]) / 2**30
    return math.ceil(need * 2) / 2 if need > 0.5 else None


def starter_data(model: Path, prompts: Path, out_dir: Path, reward_model: Path | None, algorithm: str,
                 gpus: bool, params: float | None) -> dict:
    """The config mapping before planning (paths relative to the config's directory)."""
    def rel(path: Path) -> str:  # (relative below the config's directory, else absolute)
        path, base = Path(path).resolve(), out_dir.resolve()
        return str(path.relative_to(base)) if path.is_relative_to(base) else str(path)

    name = model.resolve().name
    if name in ("model", "hf", "export") or name.startswith("step-"):
        name = model.resolve().parent.name or "run"  # (a model at /model: the file system's root is no name)
    big = params is None or params >= 1e9  # (a size not known: what is safe at any size)
    data = {
        "run": {"name": name, "algorithm": algorithm, "steps": 200, "seed": 0},
        "data": {"prompts": rel(prompts)},
        "model": {"actor": rel(model), "dtype": "bfloat16" if gpus else "float32"},
        "rollout": {"prompts_per_step": 32, "group_size": 8 if algorithm == "grpo" else 4, "max_new_tokens": 256,
                    "backend": "vllm" if gpus else "auto"},
        "reward": ({"models": [{"path": rel(reward_model)}]} if reward_model else {"functions": [
            {"function": "toolkit.rewards.examples:length_penalty", "args": {"max_chars": 800}}]}),
        "algorithm": {"kl": {"coef": 0.04 if algorithm == "grpo" else 0.05}},
        "trainer": {"lr": 1e-5 if params is not None and params < 1e8 else 1e-6, "zero_stage": 2, "micro_batch_size": 4,
                    "gradient_checkpointing": big},
        "checkpoint": {"every_steps": 20, "keep": 2},
    }
    limits = [limit[0] for limit in map(context_limit, filter(None, (model, reward_model))) if limit]
    context = min(limits, default=512)
    if context < 512:  # (the default 256 prompt + 256 new tokens would not fit)
        data["rollout"].update(max_prompt_tokens=context // 2, max_new_tokens=context - context // 2)
    if algorithm == "ppo":
        data["model"]["critic"] = rel(reward_model) if reward_model else rel(model)
    return data


def write_starter(model: str, out: str, cluster_file: str | None = None, prompts: str | None = None,
                  reward_model: str | None = None, algorithm: str = "grpo", force: bool = False) -> list[str]:
    """Write the starter config to `out`; the lines to print (what was chosen and why)."""
    from toolkit.config import load_config
    from toolkit.config.commented import commented_yaml
    from toolkit.config.schema import RunConfig
    from toolkit.data.dataset import check_data

    model_dir, target = Path(model), Path(out)
    if not (model_dir / "config.json").is_file():
        raise ConfigError(f"--model {model}: no config.json there; give a Hugging Face model directory")
    if reward_model and not (Path(reward_model) / "config.json").is_file():
        raise ConfigError(f"--reward-model {reward_model}: no config.json there; give a Hugging Face model directory")
    for flag, path, wants in (("--model", model, "lm"), ("--reward-model", reward_model, "score")):
        problem = head_problem(path, flag, wants) or tokenizer_problem(path, flag) if path else None
        if problem:
            raise ConfigError(problem)
    if prompts is not None and not Path(prompts).is_file():
        raise ConfigError(f"--prompts {prompts}: no such file; give a JSON Lines file, one {{\"prompt\": ...}} a line")
    if target.is_dir():
        raise ConfigError(f"--out {out} is a directory; give the config file to write, e.g. {target / 'run.yaml'}")
    if target.exists() and not force:
        raise ConfigError(f"{out} exists; choose another name, or --force to replace it")
    cluster = None
    if cluster_file:
        from toolkit.placement.cluster import load_cluster

        cluster = load_cluster(cluster_file)
    gpus = bool(cluster and cluster.gpus_per_node)
    shape, uncounted = _shape(model_dir, cluster_file)
    folders = [p for p in (target.parent, *target.parent.parents) if not p.exists()]  # (made here: removed on failure)
    target.parent.mkdir(parents=True, exist_ok=True)
    notes, made = [], None
    if prompts is None:
        prompts_path = target.parent / "prompts.example.jsonl"
        if not prompts_path.exists():
            prompts_path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in EXAMPLE_PROMPTS))
            made = prompts_path
        notes.append(f"example prompts in {prompts_path.absolute()}: replace them with yours (data.prompts)")
    else:
        prompts_path = Path(prompts)
    if reward_model is None:
        notes.append("the reward is a placeholder (a length penalty): put your reward functions or models in reward:")
    params = shape.params if shape is not None else None
    size = f"{params / 1e6:,.1f}M parameters" if params is not None else "a size the planner does not count"
    data = starter_data(model_dir, prompts_path, target.parent, Path(reward_model) if reward_model else None,
                        algorithm, gpus, params)
    if (cache := kv_cache_gb(shape, data)) is not None:  # (before the planner sizes it for a cluster)
        data["rollout"].setdefault("vllm", {})["kv_cache_gb"] = cache
    if shape is None:
        notes.append(f"{uncounted}; so the config has settings safe at any size (lr 1e-6, activation "
                     "checkpointing): check rollout.vllm.kv_cache_gb and the trainer's")
    header = [f"Starter config for {model_dir.resolve()} ({size}), written by "
              "`slurm-rlhf init`.", "Check it: slurm-rlhf validate FILE;  run it here: slurm-rlhf run FILE;  "
              "on Slurm: slurm-rlhf submit FILE"]
    tmp = target.parent / f".{target.name}.tmp-{os.getpid()}"
    try:
        tmp.write_text(commented_yaml(data, RunConfig) + "\n")
        cfg = load_config(tmp)
        check_data(cfg)  # (its rows too, as `validate` reads them: a --prompts file of no prompts was written)
        if cluster is not None:
            header.append(_plan_into(data, cfg, cluster, notes))
        text = "\n".join(f"# {line}" for line in header) + "\n" + commented_yaml(data, RunConfig) + "\n"
        tmp.write_text(text)
        load_config(tmp)  # (what is written validates)
        os.replace(tmp, target)
    except BaseException:
        if made is not None:  # (nothing left behind by a config that was not written)
            made.unlink(missing_ok=True)
        tmp.unlink(missing_ok=True)
        for folder in folders:  # (the deepest first)
            with contextlib.suppress(OSError):
                folder.rmdir()
        raise
    finally:
        tmp.unlink(missing_ok=True)
    wrote = f"wrote {target.absolute()}: {algorithm} on {model_dir.name} ({size})"
    return [f"{wrote}; {header[-1]}" if cluster is not None else f"{wrote}, to run on this machine", *notes]


def _plan_into(data: dict, cfg, cluster, notes: list[str]) -> str:
    """Put the planner's best plan for `cluster` into `data`; a line that says what it is."""
    from toolkit.placement.planner import placement_of, rollout_of, search, workload_of

    found = search(cluster, workload_of(cfg), cfg.trainer.zero_stage)
    fit, rejected = found.fit, found.rejected
    if not fit:
        closest = min(rejected, key=lambda c: c.estimate.step_s, default=None)
        why = "; ".join(closest.estimate.short) if closest is not None else "no layout of its nodes hosts every model"
        notes.append(f"the planner found no plan that fits {cluster.name}: {why}; the default placement is "
                     "written (see `slurm-rlhf plan` and the trainer's memory switches)")
        return f"No plan fits {cluster.name} by the planner's estimate; the default placement is written."
    s = fit[0].setting
    data["placement"] = placement_of(s, cpus_per_node=cluster.cpus_per_node)
    data["trainer"].update(zero_stage=s.zero_stage, micro_batch_size=s.micro_batch)
    rollout_of(fit[0], data["rollout"])
    return (f"Planned for {cluster.name}: {s.strategy}, {s.describe()}, ZeRO-{s.zero_stage}, micro-batch "
            f"{s.micro_batch}; estimated {fit[0].estimate.step_s:.1f} s per step")
