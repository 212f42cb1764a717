"""`slurm-rlhf init --model PATH [--cluster FILE]`: a commented starter config for a model, sized by the
planner for a cluster, that validates as written.

Without --prompts, a few example prompts are written beside the config (replace them with yours); without
--reward-model, a placeholder rule-based reward is used. The planner's best plan (placement, ZeRO stage,
micro-batch, vLLM tensor parallelism) goes in when a cluster file is given; otherwise the config runs
here with one worker per node group.
"""

from __future__ import annotations

import json
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


def _params(model: Path) -> float:
    from toolkit.placement.cost import ModelShape

    return ModelShape.from_config(str(model)).params


def starter_data(model: Path, prompts: Path, out_dir: Path, reward_model: Path | None, algorithm: str,
                 gpus: bool, params: float) -> dict:
    """The config mapping before planning (paths relative to the config's directory)."""
    def rel(path: Path) -> str:  # (relative below the config's directory, else absolute)
        path, base = Path(path).resolve(), out_dir.resolve()
        return str(path.relative_to(base)) if path.is_relative_to(base) else str(path)

    name = model.resolve().name
    if name in ("model", "hf", "export") or name.startswith("step-"):
        name = model.resolve().parent.name or "run"  # (a model at /model: the file system's root is no name)
    big = params >= 1e9
    data = {
        "run": {"name": name, "algorithm": algorithm, "steps": 200, "seed": 0},
        "data": {"prompts": rel(prompts)},
        "model": {"actor": rel(model), "dtype": "bfloat16" if gpus else "float32"},
        "rollout": {"prompts_per_step": 32, "group_size": 8 if algorithm == "grpo" else 4, "max_new_tokens": 256,
                    "backend": "vllm" if gpus else "auto"},
        "reward": ({"models": [{"path": rel(reward_model)}]} if reward_model else {"functions": [
            {"function": "toolkit.rewards.examples:length_penalty", "args": {"max_chars": 800}}]}),
        "algorithm": {"kl": {"coef": 0.04 if algorithm == "grpo" else 0.05}},
        "trainer": {"lr": 1e-6 if params >= 1e8 else 1e-5, "zero_stage": 2, "micro_batch_size": 4,
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
    target.parent.mkdir(parents=True, exist_ok=True)
    notes = []
    if prompts is None:
        prompts_path = target.parent / "prompts.example.jsonl"
        if not prompts_path.exists():
            prompts_path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in EXAMPLE_PROMPTS))
        notes.append(f"example prompts in {prompts_path}: replace them with yours (data.prompts)")
    else:
        prompts_path = Path(prompts)
    if reward_model is None:
        notes.append("the reward is a placeholder (a length penalty): put your reward functions or models in reward:")
    cluster = None
    if cluster_file:
        from toolkit.placement.cluster import load_cluster

        cluster = load_cluster(cluster_file)
    gpus = bool(cluster and cluster.gpus_per_node)
    params = _params(model_dir)
    data = starter_data(model_dir, prompts_path, target.parent, Path(reward_model) if reward_model else None,
                        algorithm, gpus, params)
    header = [f"Starter config for {model_dir.resolve()} ({params / 1e6:,.1f}M parameters), written by "
              "`slurm-rlhf init`.", "Check it: slurm-rlhf validate FILE;  run it here: slurm-rlhf run FILE;  "
              "on Slurm: slurm-rlhf submit FILE"]
    tmp = target.parent / f".{target.name}.tmp-{os.getpid()}"
    try:
        tmp.write_text(commented_yaml(data, RunConfig) + "\n")
        cfg = load_config(tmp)
        if cluster is not None:
            header.append(_plan_into(data, cfg, cluster, notes))
        text = "\n".join(f"# {line}" for line in header) + "\n" + commented_yaml(data, RunConfig) + "\n"
        tmp.write_text(text)
        load_config(tmp)  # (what is written validates)
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return [f"wrote {target}: {algorithm} on {model_dir.name} ({params / 1e6:,.1f}M parameters); {header[-1]}"
            if cluster is not None else f"wrote {target}: {algorithm} on {model_dir.name} ({params / 1e6:,.1f}M "
            "parameters), to run on this machine", *notes]


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
    data["placement"] = placement_of(s)
    data["trainer"].update(zero_stage=s.zero_stage, micro_batch_size=s.micro_batch)
    rollout_of(fit[0], data["rollout"])
    return (f"Planned for {cluster.name}: {s.strategy}, {s.describe()}, ZeRO-{s.zero_stage}, micro-batch "
            f"{s.micro_batch}; estimated {fit[0].estimate.step_s:.1f} s per step")
