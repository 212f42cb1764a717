"""The placement planner: every strategy, node split, TP size, ZeRO stage and micro-batch, estimated by
`cost.estimate`, ranked by step time; the ones that do not fit are kept with the reason.

Node groups own whole nodes under Slurm (each is one job step on its own nodes), so a strategy with k
groups needs at least k nodes; plans may leave nodes unused, so a larger cluster never gets a slower
plan. On a `shared` cluster (the local launcher) every group runs on the same machine, one worker each.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path

from toolkit.config.schema import PRESETS
from toolkit.placement.cost import DTYPE_BYTES, GB, Estimate, ModelShape, Setting, Switches, Workload, estimate
from toolkit.table import text_table

STRATEGIES = tuple(PRESETS)


@dataclass
class Candidate:
    setting: Setting
    estimate: Estimate


def workload_of(cfg, prompt_tokens: float | None = None, response_tokens: float | None = None,
                params: dict[str, float] | None = None) -> Workload:
    """The workload of run config `cfg`; `params` ({actor|reference|critic|reward: count}) replaces
    model shapes read from config.json by shapes guessed from parameter counts."""
    params = params or {}

    def shape(role: str, path) -> ModelShape:
        return ModelShape.from_params(params[role]) if role in params else ModelShape.from_config(path)

    if prompt_tokens is None:
        prompt_tokens = mean_prompt_tokens(cfg)
    t = cfg.trainer
    return Workload(
        actor=shape("actor", cfg.model.actor), reference=shape("reference", cfg.reference_path),
        critic=shape("critic", cfg.critic_path) if cfg.run.algorithm == "ppo" else None,
        reward_models=tuple(shape("reward", m.path) for m in cfg.reward.models),
        samples=cfg.samples_per_step, prompts=cfg.rollout.prompts_per_step, prompt_tokens=prompt_tokens,
        response_tokens=response_tokens if response_tokens is not None else cfg.rollout.max_new_tokens,
        dtype_bytes=DTYPE_BYTES[cfg.model.dtype], forward_batch_size=cfg.model.forward_batch_size,
        updates_per_step=cfg.trainer.updates_per_step, epochs=cfg.algorithm.epochs,
        switches=Switches(t.gradient_checkpointing, t.offload_optimizer, t.offload_params,
                          t.lora.rank if t.lora is not None else None))


def mean_prompt_tokens(cfg, limit: int = 256) -> float:
    """Mean tokens of the first `limit` prompts the run draws (cut at max_prompt_tokens)."""
    from transformers import AutoTokenizer

    from toolkit.data.prompts import read_prompts
    from toolkit.data.tokens import render_prompt

    tokenizer = AutoTokenizer.from_pretrained(cfg.tokenizer_path)
    prompts = read_prompts(cfg.data, cfg.run.seed).next(limit)
    lengths = [min(len(render_prompt(tokenizer, p.prompt, cfg.data.chat_template)), cfg.rollout.max_prompt_tokens)
               for p in prompts]
    return sum(lengths) / max(len(lengths), 1)


def candidates(cluster, w: Workload, trainer_cfg, strategies=STRATEGIES) -> list[Candidate]:
    out = []
    per_node = cluster.devices_per_node
    tps = [t for t in (1, 2, 4, 8) if cluster.gpus_per_node and cluster.gpus_per_node % t == 0] or [1]
    for strategy in strategies:
        layout = [(name, tuple(m for m in models if m != "critic" or w.critic is not None))  # GRPO: no critic
                  for name, models in PRESETS[strategy].items()]
        if cluster.shared:
            splits = [(1,) * len(layout)]
        else:
            splits = [split for n in range(len(layout), cluster.nodes + 1) for split in _compositions(n, len(layout))]
        own_generator = not any("generation" in m and "actor" in m for _, m in layout)
        for split, tp in itertools.product(splits, tps if own_generator else [1]):
            groups = []
            for (name, models), nodes in zip(layout, split):
                devices = 1 if cluster.shared else nodes * per_node
                width = tp if "generation" in models and "actor" not in models else 1
                if devices % width:
                    break
                groups.append((name, models, nodes, devices // width, width if cluster.gpus_per_node else 0))
            else:
                if next(g[3] for g in groups if "generation" in g[1]) > w.prompts:
                    continue
                trainers = next(g[3] for g in groups if "actor" in g[1])
                zeros = (1, 2, 3) if trainers > 1 else (trainer_cfg.zero_stage,)
                for zero, mb in itertools.product(zeros, _micro_batches(w, trainers)):
                    s = Setting(strategy, tuple(groups), zero, mb, tp)
                    out.append(Candidate(s, estimate(s, w, cluster)))
    return out


def _compositions(n: int, k: int):
    """Ways to cut n nodes into k groups of at least one node each."""
    for cuts in itertools.combinations(range(1, n), k - 1):
        bounds = (0, *cuts, n)
        yield tuple(b - a for a, b in zip(bounds, bounds[1:]))


def _micro_batches(w: Workload, trainers: int) -> list[int]:
    per_update = w.samples // trainers // w.updates_per_step
    if w.samples % (trainers * w.updates_per_step):
        return []
    return [m for m in (1, 2, 4, 8, 16, 32, 64) if m <= per_update and per_update % m == 0]


def rank(found: list[Candidate]) -> tuple[list[Candidate], list[Candidate]]:
    """(fitting candidates, fastest first; the others)."""
    fit = sorted((c for c in found if c.estimate.fits), key=lambda c: c.estimate.step_s)
    return fit, [c for c in found if not c.estimate.fits]


def describe_groups(s: Setting) -> str:
    return " | ".join(f"{name}[{','.join(m for m in models)}] {nodes}n x{workers}"
                      for name, models, nodes, workers, _ in s.groups)


def report(cluster, w: Workload, fit: list[Candidate], rejected: list[Candidate], top: int = 10) -> str:
    """The ranked table of `fit` (fastest first) and why the closest of `rejected` do not fit."""
    lines = [f"cluster: {cluster.name} ({cluster.nodes} node(s), "
             + (f"{cluster.gpus_per_node} GPU(s) of {cluster.device.memory_gb:g} GB each" if cluster.gpus_per_node
                else f"CPU, {cluster.device.memory_gb:g} GB") + ")",
             f"workload: {w.samples} samples/step, {w.prompt_tokens:.0f} prompt + {w.response_tokens:.0f} response "
             f"tokens, actor {w.actor.params / 1e6:,.1f}M parameters", ""]
    if fit:
        rows = [("#", "strategy", "node groups (nodes x workers)", "TP", "ZeRO", "mb", "step s", "generate", "score",
                 "train", "sync", "other", "peak GB")]
        for i, c in enumerate(fit[:top], 1):
            s, e = c.setting, c.estimate
            rows.append((str(i), s.strategy, describe_groups(s), str(s.tensor_parallel), str(s.zero_stage),
                         str(s.micro_batch), f"{e.step_s:.3f}", *(f"{e.phases[k]:.3f}" for k in
                                                                   ("generate", "score", "train", "sync", "transport")),
                         f"{max(e.memory.values()) / GB:.2f}"))
        lines.append(text_table(rows))
        lines.append(f"{len(fit)} plan(s) fit; {len(fit) - min(top, len(fit))} more not shown")
    else:
        lines.append("no placement fits this cluster.")
    if rejected:
        lines.append("")
        lines.append(f"rejected: {len(rejected)} plan(s) do not fit; the closest of each strategy:")
        for strategy in dict.fromkeys(c.setting.strategy for c in rejected):
            closest = min((c for c in rejected if c.setting.strategy == strategy),
                          key=lambda c: max(c.estimate.memory.values()))
            lines.append(f"  {strategy} ({describe_groups(closest.setting)}, ZeRO-{closest.setting.zero_stage}, "
                         f"mb {closest.setting.micro_batch}): {'; '.join(closest.estimate.short)}")
    missing = [s for s in STRATEGIES if s not in {c.setting.strategy for c in [*fit, *rejected]}]
    if missing and not cluster.shared:
        lines.append(f"not possible on {cluster.nodes} node(s) (a node group owns whole nodes): " + ", ".join(
            f"{s} ({len(PRESETS[s])} groups)" for s in missing))
    return "\n".join(lines)


def as_json(cluster, w: Workload, fit: list[Candidate], rejected: list[Candidate], top: int | None = None) -> dict:
    """`plan --json`: the cluster, the workload and every plan (the fitting ones fastest first, then the
    others closest to fitting first; `top` of each, or all), each with its groups, settings, seconds per
    phase, memory per device of each group, and whether it fits or why not."""
    def plan(c: Candidate, rank: int | None) -> dict:
        s, e = c.setting, c.estimate
        return {"rank": rank, "strategy": s.strategy, "fits": e.fits, "why_not": list(e.short),
                "groups": [{"name": name, "models": list(models), "nodes": nodes, "workers": workers,
                            "gpus_per_worker": gpus} for name, models, nodes, workers, gpus in s.groups],
                "tensor_parallel": s.tensor_parallel, "zero_stage": s.zero_stage, "micro_batch": s.micro_batch,
                "generation_engine": s.generation_engine, "step_s": e.step_s, "phases_s": dict(e.phases),
                "memory_gb_per_device": {name: need / GB for name, need in e.memory.items()}}

    closest = sorted(rejected, key=lambda c: max(c.estimate.memory.values(), default=0.0))
    return {"cluster": {"name": cluster.name, "nodes": cluster.nodes, "gpus_per_node": cluster.gpus_per_node,
                        "device_memory_gb": cluster.device.memory_gb, "shared": cluster.shared},
            "workload": {"samples": w.samples, "prompts": w.prompts, "prompt_tokens": w.prompt_tokens,
                         "response_tokens": w.response_tokens, "actor_params": w.actor.params,
                         "critic_params": w.critic.params if w.critic else None},
            "fitting": len(fit), "not_fitting": len(rejected),
            "plans": [plan(c, i) for i, c in enumerate(fit[:top], 1)] + [plan(c, None) for c in closest[:top]]}


def as_config(cfg, s: Setting) -> dict:
    """`cfg` (resolved) with the placement and parallel settings of `s`, as a config mapping."""
    data = cfg.model_dump(mode="json", exclude_none=True)
    placement = {"strategy": s.strategy, "offload": cfg.placement.offload}
    for name, models, nodes, workers, gpus in s.groups:
        old = dict(data.get("placement", {}).get(name, {}))
        old.pop("models", None)
        placement[name] = {**old, "nodes": nodes, "workers": workers, "gpus_per_worker": gpus}
    data["placement"] = placement
    data["trainer"].update(zero_stage=s.zero_stage, micro_batch_size=s.micro_batch)
    data["rollout"].setdefault("vllm", {})["tensor_parallel_size"] = s.tensor_parallel
    return data


def write_config(cfg, s: Setting, path: Path) -> None:
    import yaml

    from toolkit.config.load import validate

    data = as_config(cfg, s)
    validate(data, base_dir=path.resolve().parent, source=path)  # refuse to write what would not load
    path.write_text(f"# written by slurm-rlhf plan: {s.strategy}, {describe_groups(s)}\n"
                    + yaml.safe_dump(data, sort_keys=False))


def setting_of(cfg) -> Setting:
    """The setting a run config already asks for (to predict its step time)."""
    from toolkit.placement.plan import plan

    groups = tuple((g.name, g.models, g.nodes, g.workers, g.gpus_per_worker) for g in plan(cfg))
    return Setting(cfg.placement.strategy, groups, cfg.trainer.zero_stage, cfg.trainer.micro_batch_size,
                   cfg.rollout.vllm.tensor_parallel_size, cfg.generation_backend)
