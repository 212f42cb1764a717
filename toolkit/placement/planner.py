"""The placement planner: strategies, node splits, TP sizes, ZeRO stages and micro-batches, estimated by
`cost.estimate`, ranked by step time; the ones that do not fit are kept with the reason (see `search`
for how a large cluster is searched in seconds).

Node groups own whole nodes under Slurm (each is one job step on its own nodes), so a strategy with k
groups needs at least k nodes; plans may leave nodes unused. A generator of its own may instead take
some GPUs of each of the trainer's nodes (`same_nodes_as`: a quarter, half or three quarters of them,
in whole TP groups), the trainer the rest, as OpenRLHF runs vLLM engines beside its training models.
On a `shared` cluster (the local launcher) every group runs on the same machine, one worker each.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
from dataclasses import dataclass
from pathlib import Path

from toolkit.placement.cost import DTYPE_BYTES, GB, Estimate, ModelShape, Switches, Workload, estimate
from toolkit.placement.layout import PRESETS, Group, Layout, generation_with_actor
from toolkit.table import text_table

STRATEGIES = tuple(PRESETS)


@dataclass
class Candidate:
    setting: Layout
    estimate: Estimate


@dataclass
class Found:
    """What a search found: the fitting plans kept (fastest first) and the others kept (closest to
    fitting first, and the closest of each strategy), with how many plans were estimated and fit."""

    fit: list[Candidate]
    rejected: list[Candidate]
    fitting: int = 0
    not_fitting: int = 0
    estimated: int = 0
    strategies: tuple[str, ...] = STRATEGIES  # (those searched)


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
        kv_cache_gb=cfg.rollout.vllm.kv_cache_gb, generate_batch=cfg.rollout.generate_batch_size or 0,
        max_policy_lag=cfg.rollout.max_policy_lag,
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


def search(cluster, w: Workload, zero_stage: int, strategies=STRATEGIES, keep: int = 200) -> Found:
    """The `keep` fastest plans that fit, and the `keep` closest to fitting of the others.

    Node counts per group come from `node_counts` (every count up to 16, then 1 and 1.5 times powers of
    two, and whatever is left of the cluster); a generator never has more workers than prompts. ZeRO
    stage and micro-batch change only the trainer group: its memory, its train and sync seconds and,
    where it generates too, the generation batch that fits beside them. So on a large search (more than
    `keep` layouts of a strategy) each trainer size takes the fastest of them that fits (or, when none
    fits, the smallest) instead of every one: the best plan is the same, and 128 nodes are searched in
    seconds instead of minutes. Small searches list every setting."""
    if cluster.gpus_per_node:  # each plan sizes vLLM's KV cache or the generate() batch (--write writes it)
        w = dataclasses.replace(w, kv_cache_gb=None, generate_batch=None)
    heap: list = []  # (-step_s, n, Candidate): the `keep` fastest that fit
    closest: list = []  # (-peak, n, Candidate): the `keep` closest to fitting
    of_strategy: dict[str, tuple[float, Candidate]] = {}
    found = Found([], [], strategies=tuple(strategies))
    tps = [t for t in (1, 2, 4, 8) if cluster.gpus_per_node and cluster.gpus_per_node % t == 0] or [1]
    usable = cluster.device.memory_gb * GB

    def add(c: Candidate) -> None:
        found.estimated += 1
        if c.estimate.fits:
            found.fitting += 1
            item = (-c.estimate.step_s, found.estimated, c)
            heapq.heappush(heap, item) if len(heap) < keep else heapq.heappushpop(heap, item)
            return
        found.not_fitting += 1
        peak = max(c.estimate.memory.values())
        item = (-peak, found.estimated, c)
        heapq.heappush(closest, item) if len(closest) < keep else heapq.heappushpop(closest, item)
        if c.setting.strategy not in of_strategy or peak < of_strategy[c.setting.strategy][0]:
            of_strategy[c.setting.strategy] = (peak, c)

    for strategy in strategies:
        layout = [(name, tuple(m for m in models if m != "critic" or w.critic is not None))  # GRPO: no critic
                  for name, models in PRESETS[strategy].items()]
        own_generator = not generation_with_actor(models for _, models in layout)
        layouts = []
        for split, tp, share in _arrangements(cluster, layout, tps if own_generator else [1], own_generator):
            groups = _groups(cluster, layout, split, tp, share)
            workers = None if groups is None else next(g.workers for g in groups if "generation" in g.models)
            if workers is not None and workers <= w.prompts:
                # the actor's group generates with transformers, or, with one worker, with vLLM in the
                # trainer's process (rollout.backend vllm): both are plans
                for engine in ("vllm",) if own_generator else ("hf", "vllm") if workers == 1 else ("hf",):
                    layouts.append((groups, tp, engine))
        pick = {} if len(layouts) > keep and not cluster.shared else None  # trainer group: its (zero, mb)
        for groups, tp, engine in layouts:
            trainer = next(g for g in groups if "actor" in g.models)
            zeros = (1, 2, 3) if trainer.workers > 1 else (zero_stage,)
            options = list(itertools.product(zeros, _micro_batches(w, trainer.workers)))
            if pick is not None and options:
                if (trainer, engine) not in pick:
                    pick[trainer, engine] = _fastest_trainer(options, strategy, groups, tp, engine, w, cluster, usable)
                options = [pick[trainer, engine]]
            for zero, mb in options:
                s = Layout(strategy, groups, zero, mb, tp, engine)
                add(Candidate(s, estimate(s, w, cluster)))
    found.fit = [c for _, _, c in sorted(heap, key=lambda item: (-item[0], item[1]))]
    kept = [c for _, _, c in sorted(closest, key=lambda item: (-item[0], item[1]))]
    found.rejected = kept + [c for _, c in of_strategy.values() if c not in kept]
    return found


def node_counts(nodes: int) -> list[int]:
    """The node counts a group may have on a cluster of `nodes`: all up to 16, then 1 and 1.5 times
    powers of two (24, 32, 48, 64, ...), and `nodes` itself."""
    counts = set(range(1, min(nodes, 16) + 1)) | {nodes}
    power = 16
    while power <= nodes:
        counts |= {c for c in (power, power * 3 // 2) if c <= nodes}
        power *= 2
    return sorted(counts)


def _splits(cluster, k: int):
    """Node counts of k groups: from `node_counts`, or, for one group at a time, what the others leave
    (plans may leave nodes unused). On a `shared` cluster every group is on the same machine."""
    if cluster.shared:
        yield (1,) * k
        return
    n = cluster.nodes
    counts = node_counts(n)
    seen = set()
    for others in itertools.product(counts, repeat=k - 1):
        left = n - sum(others)
        if left < 1:
            continue
        for i in range(k):  # the group given what is left, then every count that fits in it
            for last in (left, *(c for c in counts if c < left)) if i == k - 1 else (left,):
                split = (*others[:i], last, *others[i:])
                if split not in seen:
                    seen.add(split)
                    yield split


def _arrangements(cluster, layout, tps, own_generator: bool):
    """(node counts, TP size, share) of every arrangement of `layout`'s groups: each group on nodes of its
    own (share None), and, on GPU nodes, the generator on the trainer's nodes with `d` GPUs of each
    (share (generator's index, trainer's index, d)); its node count is then the trainer's."""
    for split, tp in itertools.product(_splits(cluster, len(layout)), tps):
        yield split, tp, None
    if not own_generator or cluster.shared or cluster.gpus_per_node < 2:
        return
    names = [models for _, models in layout]
    guest = next(i for i, models in enumerate(names) if "generation" in models)
    host = next(i for i, models in enumerate(names) if "actor" in models)
    gpn = cluster.gpus_per_node
    for split, tp in itertools.product(_splits(cluster, len(layout) - 1), tps):
        full = list(split)
        full.insert(guest, split[host - (host > guest)])
        for d in sorted({d for d in (gpn // 4, gpn // 2, 3 * gpn // 4) if 0 < d < gpn and d % tp == 0}):
            yield tuple(full), tp, (guest, host, d)


def _groups(cluster, layout, split, tp, share=None) -> tuple[Group, ...] | None:
    """The groups of `layout` ((name, models), ...) on node counts `split`, and with `share` (see
    `_arrangements`) the generator on the trainer's nodes; None when a generator's TP size does not
    divide its devices."""
    groups = []
    for i, ((name, models), nodes) in enumerate(zip(layout, split)):
        group, per_node, host = Group(name, models, nodes), cluster.devices_per_node, None
        if share is not None and i == share[0]:
            per_node, host = share[2], layout[share[1]][0]
        elif share is not None and i == share[1]:
            per_node -= share[2]
        devices = 1 if cluster.shared else nodes * per_node
        width = tp if group.own_engine else 1
        if devices % width:
            return None
        groups.append(Group(name, models, nodes, devices // width, width if cluster.gpus_per_node else 0, host))
    return tuple(groups)


def _micro_batches(w: Workload, trainers: int) -> list[int]:
    per_update = w.samples // trainers // w.updates_per_step
    if w.samples % (trainers * w.updates_per_step):
        return []
    return [m for m in (1, 2, 4, 8, 16, 32, 64) if m <= per_update and per_update % m == 0]


def _fastest_trainer(options, strategy, groups, tp, engine, w, cluster, usable) -> tuple[int, int]:
    """Of (zero, micro-batch) `options`, the one with the fewest generate + train + sync seconds (only
    the trainer group's part of them changes) under which the trainer group fits its devices; when none
    fits, the one that needs the least memory."""
    name = next(g.name for g in groups if "actor" in g.models)

    def rate(option):
        e = estimate(Layout(strategy, groups, *option, tp, engine), w, cluster)
        need = e.memory[name]
        return (need > usable, need if need > usable else e.phases["generate"] + e.phases["train"] + e.phases["sync"])

    return min(options, key=rate)


def report(cluster, w: Workload, found: Found, top: int = 10) -> str:
    """The ranked table of the fitting plans (fastest first) and why the closest others do not fit."""
    fit, rejected = found.fit, found.rejected
    lines = [f"cluster: {cluster.name} ({cluster.nodes} node(s), "
             + (f"{cluster.gpus_per_node} GPU(s) of {cluster.device.memory_gb:g} GB each" if cluster.gpus_per_node
                else f"CPU, {cluster.device.memory_gb:g} GB") + ")",
             f"workload: {w.samples} samples/step, {w.prompt_tokens:.0f} prompt + {w.response_tokens:.0f} response "
             f"tokens, actor {w.actor.params / 1e6:,.1f}M parameters", ""]
    if fit:
        rows = [("#", "strategy", "node groups (nodes x workers)", "engine", "TP", "ZeRO", "mb", "step s", "generate",
                 "score", "train", "sync", "other", "peak GB")]
        for i, c in enumerate(fit[:top], 1):
            s, e = c.setting, c.estimate
            phases = (f"{e.phases[k]:.3f}" for k in ("generate", "score", "train", "sync", "transport"))
            rows.append((str(i), s.strategy, s.describe(), s.generation_engine, str(s.tensor_parallel),
                         str(s.zero_stage), str(s.micro_batch), f"{e.step_s:.3f}", *phases,
                         f"{max(e.memory.values()) / GB:.2f}"))
        lines.append(text_table(rows))
        lines.append(f"{found.fitting} plan(s) fit; {found.fitting - min(top, len(fit))} more not shown "
                     f"({found.estimated} estimated)")
    else:
        lines.append("no placement fits this cluster.")
    if rejected:
        lines.append("")
        lines.append(f"rejected: {found.not_fitting} plan(s) do not fit; the closest of each strategy:")
        for strategy in dict.fromkeys(c.setting.strategy for c in rejected):
            closest = min((c for c in rejected if c.setting.strategy == strategy),
                          key=lambda c: max(c.estimate.memory.values()))
            lines.append(f"  {strategy} ({closest.setting.describe()}, ZeRO-{closest.setting.zero_stage}, "
                         f"mb {closest.setting.micro_batch}): {'; '.join(closest.estimate.short)}")
    missing = [s for s in found.strategies if s not in {c.setting.strategy for c in [*fit, *rejected]}]
    if missing and not cluster.shared:
        lines.append(f"not possible on {cluster.nodes} node(s) (a node group owns whole nodes, except a "
                     f"generator on the trainer's): " + ", ".join(
            f"{s} ({len(PRESETS[s])} groups)" for s in missing))
    return "\n".join(lines)


def as_json(cluster, w: Workload, found: Found, top: int | None = None) -> dict:
    """`plan --json`: the cluster, the workload and the plans kept (the fitting ones fastest first, then
    the others closest to fitting first; `top` of each, or all kept), each with its groups, settings,
    seconds per phase, memory per device of each group, and whether it fits or why not."""
    fit, rejected = found.fit, found.rejected
    def plan(c: Candidate, rank: int | None) -> dict:
        s, e = c.setting, c.estimate
        return {"rank": rank, "strategy": s.strategy, "fits": e.fits, "why_not": list(e.short),
                "groups": [{"name": g.name, "models": list(g.models), "nodes": g.nodes, "workers": g.workers,
                            "gpus_per_worker": g.gpus_per_worker, "same_nodes_as": g.same_nodes_as}
                           for g in s.groups],
                "tensor_parallel": s.tensor_parallel, "zero_stage": s.zero_stage, "micro_batch": s.micro_batch,
                "generation_engine": s.generation_engine, "step_s": e.step_s, "phases_s": dict(e.phases),
                "memory_gb_per_device": {name: need / GB for name, need in e.memory.items()}}

    closest = sorted(rejected, key=lambda c: max(c.estimate.memory.values(), default=0.0))
    return {"cluster": {"name": cluster.name, "nodes": cluster.nodes, "gpus_per_node": cluster.gpus_per_node,
                        "device_memory_gb": cluster.device.memory_gb, "shared": cluster.shared},
            "workload": {"samples": w.samples, "prompts": w.prompts, "prompt_tokens": w.prompt_tokens,
                         "response_tokens": w.response_tokens, "actor_params": w.actor.params,
                         "critic_params": w.critic.params if w.critic else None},
            "fitting": found.fitting, "not_fitting": found.not_fitting, "estimated": found.estimated,
            "plans": [plan(c, i) for i, c in enumerate(fit[:top], 1)] + [plan(c, None) for c in closest[:top]]}


def kv_cache_gb(c: Candidate) -> float:
    """The KV cache per device a plan gives a vLLM engine, as `rollout.vllm.kv_cache_gb` (0.1 GB steps)."""
    return max(0.1, math.floor(c.estimate.kv_cache_gb * 10) / 10)


def as_config(cfg, c: Candidate) -> dict:
    """`cfg` (resolved) with the placement and parallel settings of plan `c`, as a config mapping."""
    s = c.setting
    data = cfg.model_dump(mode="json", exclude_none=True)
    placement = {"strategy": s.strategy, "offload": cfg.placement.offload}
    for g in s.groups:
        old = dict(data.get("placement", {}).get(g.name, {}))
        old.pop("models", None)
        old.pop("same_nodes_as", None)
        placement[g.name] = {**old, "nodes": g.nodes, "workers": g.workers, "gpus_per_worker": g.gpus_per_worker}
        if g.same_nodes_as:
            placement[g.name]["same_nodes_as"] = g.same_nodes_as
    data["placement"] = placement
    data["trainer"].update(zero_stage=s.zero_stage, micro_batch_size=s.micro_batch)
    rollout_of(c, data["rollout"])
    return data


def rollout_of(c: Candidate, rollout: dict) -> None:
    """Put plan `c`'s generation settings into a config's `rollout` mapping: the engine it was estimated
    with (`backend`), vLLM's TP size and KV cache, or the transformers batch."""
    s = c.setting
    rollout["backend"] = s.generation_engine
    vllm = rollout.setdefault("vllm", {})
    vllm["tensor_parallel_size"] = s.tensor_parallel
    if s.generation_engine == "vllm":
        vllm["kv_cache_gb"] = kv_cache_gb(c)
        rollout.pop("generate_batch_size", None)
    else:
        rollout["generate_batch_size"] = c.estimate.generate_batch


def write_config(cfg, c: Candidate, path: Path) -> None:
    import yaml

    from toolkit.config.load import validate

    data = as_config(cfg, c)
    s = c.setting
    validate(data, base_dir=path.resolve().parent, source=path)  # refuse to write what would not load
    path.write_text(f"# written by slurm-rlhf plan: {s.strategy}, {s.describe()}\n"
                    + yaml.safe_dump(data, sort_keys=False))


def setting_of(cfg) -> Layout:
    """The setting a run config already asks for (to predict its step time)."""
    from toolkit.placement.plan import plan

    groups = tuple(Group(g.name, g.models, g.nodes, g.workers, g.gpus_per_worker, g.same_nodes_as) for g in plan(cfg))
    tp = cfg.rollout.vllm.tensor_parallel_size if any(g.own_engine for g in groups) else 1  # (the actor's: whole)
    return Layout(cfg.placement.strategy, groups, cfg.trainer.zero_stage, cfg.trainer.micro_batch_size, tp,
                  cfg.generation_backend)
