"""The placement planner: strategies, node splits, TP sizes, ZeRO stages and micro-batches, estimated by
`cost.estimate`, ranked by step time; the ones that do not fit are kept with the reason (see `search`
for how a large cluster is searched in seconds).

Node groups own whole nodes under Slurm (each is one job step on its own nodes), so a strategy with k
groups needs at least k nodes; plans may leave nodes unused. A generator of its own may instead take
some GPUs of each of the trainer's nodes (`same_nodes_as`: a quarter, half or three quarters of them,
in whole TP groups), the trainer the rest, as OpenRLHF runs vLLM engines beside its training models.
With PPO and a generator of its own, the critic may also train on ranks of its own (`CRITIC_APART`), as
many as the actor's: on nodes of its own, or on half of the actor's GPUs of each of its nodes.
On a `shared` cluster (the local launcher) every group runs on the same machine, one worker each.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import itertools
import math
import os
from dataclasses import dataclass
from pathlib import Path

from toolkit.config.model_files import tp_splits
from toolkit.placement.cost import DTYPE_BYTES, GB, Estimate, ModelShape, Switches, Workload, estimate, group_memory
from toolkit.placement.layout import PRESETS, Group, Layout, generates_with_actor, generation_with_actor
from toolkit.placement.plan import several_roles
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
    skipped: dict[str, int] = dataclasses.field(default_factory=dict)  # strategy: layouts not estimated
    strategies: tuple[str, ...] = STRATEGIES  # (those searched)
    unused: tuple[str, ...] = ()  # presets with a group that would host nothing of this run (LoRA: a reference's)
    why_not: dict[str, str] = dataclasses.field(default_factory=dict)  # strategy: why none of its layouts can
    # run this step (more generator workers than prompts, or samples that do not split over the trainer's ranks)


def workload_of(cfg, prompt_tokens: float | None = None, response_tokens: float | None = None,
                params: dict[str, float] | None = None) -> Workload:
    """The workload of run config `cfg`; `params` ({actor|reference|critic|reward: count}) replaces
    model shapes read from config.json by shapes guessed from parameter counts."""
    params = params or {}

    def shape(role: str, path) -> ModelShape:
        return ModelShape.from_params(params[role]) if role in params else ModelShape.from_config(path)

    longest = None  # (prompt lengths given: no longest known; each is the mean's)
    if prompt_tokens is None:
        prompt_tokens, longest = prompt_tokens_of(cfg)
    t = cfg.trainer
    return Workload(
        actor=shape("actor", cfg.model.actor),
        reference=shape("reference", cfg.reference_path) if cfg.hosts("reference") else None,  # (LoRA: none)
        critic=shape("critic", cfg.critic_path) if cfg.run.algorithm == "ppo" else None,
        reward_models=tuple(shape("reward", m.path) for m in cfg.reward.models),
        samples=cfg.samples_per_step, prompts=cfg.rollout.prompts_per_step, prompt_tokens=prompt_tokens,
        response_tokens=response_tokens if response_tokens is not None else cfg.rollout.max_new_tokens,
        longest_prompt_tokens=longest, max_model_len=cfg.rollout.max_prompt_tokens + cfg.rollout.max_new_tokens,
        dtype_bytes=DTYPE_BYTES[cfg.model.dtype], forward_batch_size=cfg.model.forward_batch_size,
        kv_cache_gb=cfg.rollout.vllm.kv_cache_gb, generate_batch=cfg.rollout.generate_batch_size or 0,
        max_policy_lag=cfg.rollout.max_policy_lag, micro_batch_tokens=t.micro_batch_tokens,
        ptx_tokens=cfg.ptx.max_tokens if cfg.ptx.coef > 0 else 0, old_logprobs_forward=not cfg.old_logprobs_at_update,
        backend=cfg.rollout.backend,
        updates_per_step=cfg.trainer.updates_per_step, epochs=cfg.algorithm.epochs,
        switches=Switches(t.gradient_checkpointing, t.offload_optimizer, t.offload_params,
                          t.lora.rank if t.lora is not None else None,
                          tuple(t.lora.target_modules) if t.lora is not None and t.lora.target_modules != "all-linear"
                          else None))


def prompt_tokens_of(cfg, limit: int = 256) -> tuple[float, int]:
    """(mean, longest) tokens of the first `limit` prompts the run draws (cut at max_prompt_tokens)."""
    lengths = prompt_lengths(cfg, limit)
    return sum(lengths) / max(len(lengths), 1), max(lengths, default=0)


def prompt_lengths(cfg, limit: int = 256) -> list[int]:
    """Tokens of each of the first `limit` prompts the run draws (cut at max_prompt_tokens): their mean sets
    the time of a step, their longest the memory of its largest batches."""
    from toolkit.data.prompts import read_prompts
    from toolkit.data.tokens import counting_tokenizer, render_prompt

    tokenizer = counting_tokenizer(cfg.tokenizer_path)
    prompts = read_prompts(cfg.data, cfg.run.seed).next(limit)
    return [min(len(render_prompt(tokenizer, p.prompt, cfg.data.chat_template)), cfg.rollout.max_prompt_tokens)
            for p in prompts]


def search(cluster, w: Workload, zero_stage: int, strategies=STRATEGIES, keep: int = 200,
           offload: bool | None = None) -> Found:
    """The `keep` fastest plans that fit, and the `keep` closest to fitting of the others (`offload`:
    only plans with that `placement.offload`; None: with and without, where it makes a difference).

    Node counts per group come from `node_counts` (every count up to 16, then 1 and 1.5 times powers of
    two, and whatever is left of the cluster); a generator never has more workers than prompts. ZeRO
    stage and micro-batch change only the trainer group: its memory, its train and sync seconds and,
    where it generates too, the generation batch that fits beside them. So on a large search (more than
    `keep` layouts of a strategy) each trainer size takes the fastest of them that fits (or, when none
    fits, the smallest) instead of every one. Then every layout's memory is known from its groups'
    (`group_memory`, once per group and setting), and only the layouts that can be among those kept are
    estimated whole: those that fit in the order of the least seconds their step can take (generation
    plus training, `_bounds`) until the next cannot beat the slowest of the `keep` kept; those that do
    not, the least memory first, until the next cannot be closer than those kept. The best plans are the
    ones trying everything finds, and 1,024 nodes are searched in seconds instead of hours. Small
    searches estimate every setting of every layout."""
    if cluster.gpus_per_node:  # each plan sizes vLLM's KV cache or the generate() batch (--write writes it)
        w = dataclasses.replace(w, kv_cache_gb=None, generate_batch=None)
    heap: list = []  # (-step_s, n, Candidate): the `keep` fastest that fit
    closest: list = []  # (-peak, n, Candidate): the `keep` closest to fitting
    of_strategy: dict[str, tuple[float, Candidate]] = {}
    # (LoRA: no reference model; a preset whose group would host nothing else is no layout of this run)
    layouts_of = {strategy: _preset_layout(strategy, w) for strategy in strategies}
    unused = tuple(strategy for strategy in strategies if layouts_of[strategy] is None)
    strategies = [strategy for strategy in strategies if layouts_of[strategy] is not None]
    found = Found([], [], strategies=tuple(strategies), unused=unused)
    # (vLLM gives each rank as many attention heads and key/value heads: a size that does not split the
    # policy's cannot start; a shape guessed from a parameter count knows neither)
    tps = [t for t in (1, 2, 4, 8) if cluster.gpus_per_node and cluster.gpus_per_node % t == 0
           and tp_splits(w.actor.heads, w.actor.kv_heads if w.actor.heads else None, t)
           and (t == 1 or w.backend != "hf")] or [1]  # (transformers' generate() has no TP of its own)
    usable = cluster.device.memory_gb * GB
    settings: dict = {}  # (trainer ranks, trainer groups): their (ZeRO stage, micro-batch) settings

    def add(c: Candidate, counted: bool = False) -> None:
        """Estimated plan `c` among those kept (`counted`: already in the counts of those that fit or not)."""
        found.estimated += 1
        if not counted:
            count(c.estimate.fits)
        if c.estimate.fits:
            item = (-c.estimate.step_s, found.estimated, c)
            heapq.heappush(heap, item) if len(heap) < keep else heapq.heappushpop(heap, item)
            return
        peak = max(c.estimate.memory.values())
        item = (-peak, found.estimated, c)
        heapq.heappush(closest, item) if len(closest) < keep else heapq.heappushpop(closest, item)
        if c.setting.strategy not in of_strategy or peak < of_strategy[c.setting.strategy][0]:
            of_strategy[c.setting.strategy] = (peak, c)

    def count(fits: bool) -> None:
        if fits:
            found.fitting += 1
        else:
            found.not_fitting += 1

    remembered: dict = {}

    def memory(g, s, w, cluster):
        """`group_memory`, remembered for each group and trainer and generator setting."""
        key = (g, s.zero_stage, s.micro_batch, s.tensor_parallel, s.generation_engine, s.offload)
        if key not in remembered:
            remembered[key] = group_memory(g, s, w, cluster)
        return remembered[key]

    def distinct(s) -> bool:
        """Whether plan `s` is one of its own: one that offloads and moves nothing is its twin without
        (unless `offload` pins it on)."""
        return not s.offload or offload is True or any(memory(g, s, w, cluster).moves for g in s.groups)

    for strategy in strategies:
        layout = layouts_of[strategy]
        own_generator = not generation_with_actor(models for _, models in layout)
        # PPO: the critic with the actor, or on ranks of its own (with a generator of its own, as OpenRLHF
        # runs it)
        critics = (None, *CRITIC_APART) if w.critic is not None and own_generator else (None,)
        layouts, generators = [], []  # (generators: the worker count of each arrangement's generator)
        offloads = _offloads(cluster, [models for _, models in layout], offload)  # (a critic apart: the same roles)
        for critic in critics:
            for split, tp, share in _arrangements(cluster, layout, tps if own_generator else [1], own_generator, critic):
                groups = _groups(cluster, layout, split, tp, share, critic)
                workers = None if groups is None else next(g.workers for g in groups if "generation" in g.models)
                generators += [workers] * (workers is not None)
                if workers is not None and workers <= w.prompts:
                    trainers, options = _trainer_options(w, groups, zero_stage, settings)
                    # the actor's group generates with transformers, or with vLLM in each trainer rank's
                    # process (rollout.backend vllm): both are plans, unless rollout.backend names one
                    for engine in _engines(w, own_generator):
                        for moves in offloads:
                            layouts.append((groups, tp, engine, moves, trainers, options))
        if generators and not layouts:
            found.why_not[strategy] = (f"its generator would have {min(generators)} worker(s) or more, more than "
                                       f"the step's {w.prompts} prompt(s) (rollout.prompts_per_step)")
        elif layouts and not any(options for *_, options in layouts):  # (the samples split over none of them)
            ranks = sorted({trainers[0].workers for *_, trainers, _ in layouts})
            found.why_not[strategy] = (
                f"the step's {w.samples} samples do not split evenly over its trainer's "
                f"{' or '.join(map(str, ranks))} rank(s) x trainer.updates_per_step {w.updates_per_step}")
        if len(layouts) <= keep or cluster.shared:  # (a small search: every setting of every layout)
            for groups, tp, engine, moves, trainers, options in layouts:
                for zero, mb in options:
                    s = Layout(strategy, groups, zero, mb, tp, engine, moves)
                    if distinct(s):
                        add(Candidate(s, estimate(s, w, cluster, memory)))
            continue
        pick = {}  # trainer groups, engine and offload: their (zero, micro-batch) and training seconds
        for groups, tp, engine, moves, trainers, options in layouts:
            if options and (trainers, engine, moves) not in pick:
                pick[trainers, engine, moves] = _fastest_trainer(options, strategy, groups, tp, engine, moves, w,
                                                                 cluster, usable, memory)
        # Each layout with its trainer's setting; its memory per group is known without an estimate.
        plans = [Layout(strategy, groups, *pick[trainers, engine, moves][0], tp, engine, moves)
                 for groups, tp, engine, moves, trainers, options in layouts if options]
        # Offloading only adds moves where the generator is a group of its own: a plan with it is slower
        # than its twin without it, when that fits with the same trainer setting (else it may fit, or fit a
        # larger micro-batch: it is weighed). So the plans without it go first.
        fits, short, fitting = [], [], set()
        for s in sorted(plans, key=lambda s: s.offload):
            if not distinct(s):
                continue
            if s.offload and dataclasses.replace(s, offload=False) in fitting:
                count(True)
                found.skipped[strategy] = found.skipped.get(strategy, 0) + 1
                continue
            need = [memory(g, s, w, cluster) for g in s.groups]
            ok = all(m.need <= usable and not m.short for m in need)
            count(ok)
            if ok and not s.offload and not several_roles(s.group("generation").models):
                fitting.add(s)
            (fits if ok else short).append((s, max(m.need for m in need)))
        # Bounds. A plan takes at least its generation and training seconds: those that fit go least first,
        # and once `keep` plans are kept, the rest that take longer than every plan kept are not estimated.
        # Of those that do not fit, the least memory first, until `keep` are kept and each strategy's closest.
        bounds = _bounds([s for s, _ in fits], pick, w, cluster, memory)
        order = sorted(range(len(fits)), key=bounds.__getitem__)
        for n, i in enumerate(order):
            if len(heap) == keep and bounds[i] >= -heap[0][0]:
                found.skipped[strategy] = found.skipped.get(strategy, 0) + len(fits) - n
                break
            add(Candidate(fits[i][0], estimate(fits[i][0], w, cluster, memory)), counted=True)
        short.sort(key=lambda x: x[1])
        for n, (s, peak) in enumerate(short):
            if len(closest) == keep and peak >= -closest[0][0] and strategy in of_strategy:
                found.skipped[strategy] = found.skipped.get(strategy, 0) + len(short) - n
                break
            add(Candidate(s, estimate(s, w, cluster, memory)), counted=True)
    found.fit = [c for _, _, c in sorted(heap, key=lambda item: (-item[0], item[1]))]
    kept = [c for _, _, c in sorted(closest, key=lambda item: (-item[0], item[1]))]
    found.rejected = kept + [c for _, c in of_strategy.values() if c not in kept]
    return found


def _engines(w: Workload, own_generator: bool) -> tuple[str, ...]:
    """The generation engines to weigh: the one rollout.backend names, or (auto) vLLM for a generator of
    its own and either where the actor's group generates."""
    if w.backend != "auto":
        return (w.backend,)
    return ("vllm",) if own_generator else ("hf", "vllm")


def _preset_layout(strategy: str, w: Workload) -> list[tuple[str, tuple[str, ...]]] | None:
    """The groups ((name, models), ...) of preset `strategy` with the models workload `w` has: no critic
    but with PPO, no reference with LoRA (the actor without its adapters, run by the trainer); None when a
    group would then host nothing (colocate_critic_reward's reference group, under LoRA)."""
    missing = {m for m, shape in (("critic", w.critic), ("reference", w.reference)) if shape is None}
    layout = [(name, tuple(m for m in models if m not in missing)) for name, models in PRESETS[strategy].items()]
    return None if any(not models for _, models in layout) else layout


def _offloads(cluster, groups_models, only: bool | None = None) -> tuple[bool, ...]:
    """The `placement.offload` settings worth weighing for groups hosting `groups_models` (`only` that one,
    when given): both on GPUs where a group hosts several roles (it frees the device for each phase, and
    costs the moves over PCIe), off elsewhere (it would change nothing)."""
    if only is not None:
        return (only,)
    return (False, True) if cluster.gpus_per_node and any(map(several_roles, groups_models)) else (False,)


def node_counts(nodes: int) -> list[int]:
    """The node counts a group may have on a cluster of `nodes`: all up to 16, then 1 and 1.5 times
    powers of two (24, 32, 48, 64, ...), and `nodes` itself."""
    counts = set(range(1, min(nodes, 16) + 1)) | {nodes}
    power = 16
    while power <= nodes:
        counts |= {c for c in (power, power * 3 // 2) if c <= nodes}
        power *= 2
    return sorted(counts)


def _splits(cluster, k: int, double: int | None = None):
    """Node counts of k groups: from `node_counts`, or, for one group at a time, what the others leave
    (plans may leave nodes unused). Group `double` needs its count twice (a critic group of its own on as
    many nodes beside it). On a `shared` cluster every group is on the same machine."""
    if cluster.shared:
        yield (1,) * k
        return
    n = cluster.nodes
    counts = node_counts(n)
    weight = [2 if i == double else 1 for i in range(k)]
    seen = set()
    for others in itertools.product(counts, repeat=k - 1):
        for i in range(k):  # the group given what is left, then every count that fits in it
            left = (n - sum(c * wt for c, wt in zip(others, weight[:i] + weight[i + 1:]))) // weight[i]
            if left < 1:
                continue
            for last in (left, *(c for c in counts if c < left)) if i == k - 1 else (left,):
                split = (*others[:i], last, *others[i:])
                if split not in seen:
                    seen.add(split)
                    yield split


# Where a critic trains, in the planner's plans: with the actor (None), in a group of its own on as many
# nodes ("nodes"), or on the actor's nodes, half of the GPUs the actor's group would have ("beside":
# OpenRLHF's 4 actor + 4 critic GPUs of a node).
CRITIC_APART = ("nodes", "beside")


def _arrangements(cluster, layout, tps, own_generator: bool, critic: str | None = None):
    """(node counts, TP size, share) of every arrangement of `layout`'s groups: each group on nodes of its
    own (share None), and, on GPU nodes, the generator on the trainer's nodes with `d` GPUs of each
    (share (generator's index, trainer's index, d)); its node count is then the trainer's. With the
    critic on nodes of its own (`critic` "nodes"), the actor's group's nodes count twice."""
    names = [models for _, models in layout]
    host = next(i for i, models in enumerate(names) if "actor" in models)
    double = host if critic == "nodes" else None
    for split, tp in itertools.product(_splits(cluster, len(layout), double), tps):
        yield split, tp, None
    if not own_generator or cluster.shared or cluster.gpus_per_node < 2:
        return
    guest = next(i for i, models in enumerate(names) if "generation" in models)
    gpn = cluster.gpus_per_node
    left = host - (host > guest)  # (the trainer's index without the generator)
    for split, tp in itertools.product(_splits(cluster, len(layout) - 1, left if critic == "nodes" else None), tps):
        full = list(split)
        full.insert(guest, split[left])
        for d in sorted({d for d in (gpn // 4, gpn // 2, 3 * gpn // 4) if 0 < d < gpn and d % tp == 0}):
            yield tuple(full), tp, (guest, host, d)


_group = functools.lru_cache(maxsize=1 << 16)(Group)


def _groups(cluster, layout, split, tp, share=None, critic: str | None = None) -> tuple[Group, ...] | None:
    """The groups of `layout` ((name, models), ...) on node counts `split`, with `share` (see
    `_arrangements`) the generator on the trainer's nodes, and with `critic` (`CRITIC_APART`) the critic
    in a group `critic` of its own after the actor's; None when a generator's TP size does not divide
    its devices, or the actor's GPUs of a node cannot be halved. (Called for every arrangement of a
    large search, where the same groups come back again and again: `_group` makes each once.)"""
    groups = []
    gpus = 1 if cluster.gpus_per_node else 0
    for i, ((name, models), nodes) in enumerate(zip(layout, split)):
        per_node, host = cluster.devices_per_node, None
        if share is not None and i == share[0]:
            per_node, host = share[2], layout[share[1]][0]
        elif share is not None and i == share[1]:
            per_node -= share[2]
        devices = 1 if cluster.shared else nodes * per_node
        if critic is not None and "actor" in models:
            alone = tuple(m for m in models if m != "critic")
            if critic == "beside":  # (each rank of the critic on the node of the actor's rank it pairs with)
                if cluster.shared or per_node % 2:
                    return None
                groups += [_group(name, alone, nodes, devices // 2, gpus),
                           _group("critic", ("critic",), nodes, devices // 2, gpus, name)]
            else:
                groups += [_group(name, alone, nodes, devices, gpus), _group("critic", ("critic",), nodes, devices, gpus)]
            continue
        width = tp if "generation" in models and not generates_with_actor(models) else 1
        if devices % width:
            return None
        groups.append(_group(name, models, nodes, devices // width, width * gpus, host))
    return tuple(groups)


def _bounds(plans: list[Layout], pick, w: Workload, cluster, memory) -> list[float]:
    """The least step seconds of each of `plans` (with its trainer groups' setting from `pick`):
    generation plus training (their larger, where generation of the next steps overlaps training).
    Generation depends on the generating group alone (and, where it is the actor's, on the trainer's
    setting), training on the trainer groups alone, so each is estimated once a kind. Searching the
    plans in this order, the search stops at the first that takes longer than every plan it keeps."""
    generating: dict = {}
    bounds = []
    for s in plans:
        trainers, gen = s.trainers, s.group("generation")
        key = (gen, s.tensor_parallel, s.generation_engine, s.offload) + (
            () if gen.own_engine else (trainers, s.zero_stage, s.micro_batch))
        if key not in generating:
            generating[key] = estimate(s, w, cluster, memory).phases["generate"]
        train_s = pick[trainers, s.generation_engine, s.offload][1]
        overlap = w.max_policy_lag >= 1 and gen.own_engine
        bounds.append(max(generating[key], train_s) if overlap else generating[key] + train_s)
    return bounds


def _trainer_options(w: Workload, groups, zero_stage: int, memo: dict) -> tuple[tuple[Group, ...], list]:
    """The trainer groups of `groups` (as `Layout.trainers`: the actor's, then a critic's of its own),
    and the (ZeRO stage, micro-batch) settings they may take: any stage with several ranks, the run's with
    one, and only ZeRO-3 under trainer.offload_params (which needs it). `memo` keeps the settings of each
    rank count."""
    trainers = tuple(g for g in groups if "actor" in g.models or "critic" in g.models)
    key = trainers[0].workers
    if key not in memo:
        zeros = (3,) if w.switches.offload_params else (1, 2, 3) if key > 1 else (zero_stage,)
        memo[key] = list(itertools.product(zeros, _micro_batches(w, key)))
    return trainers, memo[key]


def _micro_batches(w: Workload, trainers: int) -> list[int]:
    """The micro-batch sizes (rows) a trainer of `trainers` ranks may take: those that split each rank's
    samples of an update. By token budget (trainer.micro_batch_tokens) the budget sizes micro-batches,
    and micro_batch_size only has to split them: 1."""
    per_update = w.samples // trainers // w.updates_per_step
    if w.samples % (trainers * w.updates_per_step):
        return []
    if w.micro_batch_tokens is not None:
        return [1]
    return [m for m in (1, 2, 4, 8, 16, 32, 64) if m <= per_update and per_update % m == 0]


def _fastest_trainer(options, strategy, groups, tp, engine, offload, w, cluster, usable,
                     memory=group_memory) -> tuple[tuple[int, int], float]:
    """Of (zero, micro-batch) `options`, the one with the fewest generate + train + sync seconds (only
    the trainer groups' part of them changes) under which the trainer groups fit their devices; when
    none fits, the one that needs the least memory. With its seconds of training (which depend on the
    trainer groups alone, whatever the other groups are)."""
    names = [g.name for g in groups if g.trains]

    def rate(option):
        e = estimate(Layout(strategy, groups, *option, tp, engine, offload), w, cluster, memory)
        need = max(e.memory[name] for name in names)
        return (need > usable, need if need > usable else e.phases["generate"] + e.phases["train"] + e.phases["sync"],
                e.phases["train"])

    rates = {option: rate(option) for option in options}
    best = min(options, key=lambda option: rates[option][:2])
    return best, rates[best][2]


def report(cluster, w: Workload, found: Found, top: int = 10) -> str:
    """The ranked table of the fitting plans (fastest first) and why the closest others do not fit."""
    fit, rejected = found.fit, found.rejected
    longest = ("" if w.longest_prompt_tokens is None or w.longest_prompt_tokens == w.prompt_tokens
               else f" (memory for prompts of {w.longest_prompt_tokens:.0f}, the longest read)")
    lines = [f"cluster: {cluster.name} ({cluster.nodes} node(s), "
             + (f"{cluster.gpus_per_node} GPU(s) of {cluster.device.memory_gb:g} GB each" if cluster.gpus_per_node
                else f"CPU, {cluster.device.memory_gb:g} GB") + ")",
             f"workload: {w.samples} samples/step, {w.prompt_tokens:.0f} prompt + {w.response_tokens:.0f} response "
             f"tokens{longest}, actor {w.actor.params / 1e6:,.1f}M parameters", ""]
    if fit:
        rows = [("#", "strategy", "node groups (nodes x workers)", "engine", "offload", "TP", "ZeRO", "mb", "step s",
                 "generate", "score", "train", "sync", "other", "peak GB")]
        for i, c in enumerate(fit[:top], 1):
            s, e = c.setting, c.estimate
            phases = (f"{e.phases[k]:.3f}" for k in ("generate", "score", "train", "sync", "transport"))
            rows.append((str(i), s.strategy, s.describe(), s.generation_engine, "yes" if s.offload else "-",
                         str(s.tensor_parallel),
                         str(s.zero_stage), mb_of(w, s), f"{e.step_s:.3f}", *phases,
                         f"{max(e.memory.values()) / GB:.2f}"))
        lines.append(text_table(rows))
        skipped = sum(found.skipped.values())
        lines.append(f"{found.fitting} plan(s) fit; {found.fitting - min(top, len(fit))} more not shown "
                     f"({found.estimated} estimated whole" + (
                         f"; {skipped} not, as they could be neither faster than the {len(fit)} kept nor closer "
                         "to fitting than the closest" if skipped else "") + ")")
    else:
        lines.append("no placement fits this cluster.")
    if rejected:
        lines.append("")
        lines.append(f"rejected: {found.not_fitting} plan(s) do not fit; the closest of each strategy:")
        for strategy in dict.fromkeys(c.setting.strategy for c in rejected):
            closest = min((c for c in rejected if c.setting.strategy == strategy),
                          key=lambda c: max(c.estimate.memory.values()))
            lines.append(f"  {strategy} ({closest.setting.describe()}, ZeRO-{closest.setting.zero_stage}, "
                         f"mb {mb_of(w, closest.setting)}{', offload' * closest.setting.offload}): "
                         f"{'; '.join(closest.estimate.short)}")
    missing = [s for s in found.strategies if s not in {c.setting.strategy for c in [*fit, *rejected]}
               and s not in found.skipped and s not in found.why_not]
    for strategy, why in found.why_not.items():
        lines.append(f"not possible with this step: {strategy} ({why}; change rollout.prompts_per_step or "
                     "group_size)")
    if found.unused:
        lines.append("not weighed, as a group of theirs would host nothing (with trainer.lora the reference is "
                     "the actor without its adapters, run by the trainer): " + ", ".join(found.unused))
    if missing and not cluster.shared:
        lines.append(f"not possible on {cluster.nodes} node(s) (a node group owns whole nodes, except a "
                     f"generator on the trainer's): " + ", ".join(
            f"{s} ({len(PRESETS[s])} groups)" for s in missing))
    return "\n".join(lines)


def mb_of(w: Workload, s: Layout) -> str:
    """The table's micro-batch: rows, or by token budget (trainer.micro_batch_tokens) its tokens."""
    return str(s.micro_batch) if w.micro_batch_tokens is None else f"{w.micro_batch_tokens}t"


def as_json(cluster, w: Workload, found: Found, top: int | None = None) -> dict:
    """`plan --json`: the cluster, the workload and the plans kept (the fitting ones fastest first, then
    the others closest to fitting first; `top` of each, or all kept), each with its groups, settings,
    seconds per phase, memory per device of each group, and whether it fits or why not."""
    fit, rejected = found.fit, found.rejected
    def plan(c: Candidate, rank: int | None) -> dict:
        s, e = c.setting, c.estimate
        return {"rank": rank, "strategy": s.strategy, "critic_apart": s.critic_apart, "fits": e.fits,
                "why_not": list(e.short),
                "groups": [{"name": g.name, "models": list(g.models), "nodes": g.nodes, "workers": g.workers,
                            "gpus_per_worker": g.gpus_per_worker, "same_nodes_as": g.same_nodes_as}
                           for g in s.groups],
                "tensor_parallel": s.tensor_parallel, "zero_stage": s.zero_stage, "micro_batch": s.micro_batch,
                "generation_engine": s.generation_engine, "offload": s.offload, "step_s": e.step_s,
                "phases_s": dict(e.phases),
                "memory_gb_per_device": {name: need / GB for name, need in e.memory.items()}}

    closest = sorted(rejected, key=lambda c: max(c.estimate.memory.values(), default=0.0))
    return {"cluster": {"name": cluster.name, "nodes": cluster.nodes, "gpus_per_node": cluster.gpus_per_node,
                        "device_memory_gb": cluster.device.memory_gb, "shared": cluster.shared},
            "workload": {"samples": w.samples, "prompts": w.prompts, "prompt_tokens": w.prompt_tokens,
                         "longest_prompt_tokens": w.longest_prompt_tokens,
                         "response_tokens": w.response_tokens, "actor_params": w.actor.params,
                         "critic_params": w.critic.params if w.critic else None},
            "fitting": found.fitting, "not_fitting": found.not_fitting, "estimated": found.estimated,
            "skipped": sum(found.skipped.values()),
            "plans": [plan(c, i) for i, c in enumerate(fit[:top], 1)] + [plan(c, None) for c in closest[:top]]}


def kv_cache_gb(c: Candidate) -> float:
    """The KV cache per device a plan gives a vLLM engine, as `rollout.vllm.kv_cache_gb` (GiB, 0.1 steps)."""
    return max(0.1, math.floor(c.estimate.kv_cache_gb * 10) / 10)


def as_config(cfg, c: Candidate, cpus_per_node: int | None = None) -> dict:
    """`cfg` (resolved) with the placement and parallel settings of plan `c`, as a config mapping (on nodes of
    `cpus_per_node` cores: see placement_of)."""
    s = c.setting
    data = cfg.model_dump(mode="json", exclude_none=True)
    data["placement"] = placement_of(s, data.get("placement", {}), cpus_per_node)
    data["placement"]["offload"] = s.offload
    data["trainer"].update(zero_stage=s.zero_stage, micro_batch_size=s.micro_batch)
    rollout_of(c, data["rollout"])
    return data


def placement_of(s: Layout, before: dict | None = None, cpus_per_node: int | None = None) -> dict:
    """The `placement` mapping of layout `s`: its strategy and each group's nodes, workers, GPUs per worker
    and the group whose nodes it shares, over what `before` (a config's placement) set for a group of
    that name (its CPUs, memory, partition). A critic on ranks of its own is no preset: the groups are
    then listed with their models (`custom`). On nodes of `cpus_per_node` cores, a GPU group that `before`
    gives no `cpus_per_worker` gets its workers' share of their nodes' cores (Slurm's default: one each)."""
    placement = {"strategy": "custom" if s.critic_apart else s.strategy}
    for g in s.groups:
        old = {k: v for k, v in dict((before or {}).get(g.name) or {}).items() if k not in ("models", "same_nodes_as")}
        placement[g.name] = {**({"models": list(g.models)} if s.critic_apart else {}), **old, "nodes": g.nodes,
                             "workers": g.workers, "gpus_per_worker": g.gpus_per_worker}
        if g.same_nodes_as:
            placement[g.name]["same_nodes_as"] = g.same_nodes_as
        if cpus_per_node and g.gpus_per_worker and "cpus_per_worker" not in old:
            home = g.same_nodes_as or g.name  # (the groups on these nodes: the one that owns them, and its guests)
            tasks = sum(o.tasks_per_node for o in s.groups if home in (o.name, o.same_nodes_as))
            placement[g.name]["cpus_per_worker"] = max(1, cpus_per_node // tasks)
    return placement


def rollout_of(c: Candidate, rollout: dict) -> None:
    """Put plan `c`'s generation settings into a config's `rollout` mapping: the engine it was estimated
    with (`backend`), vLLM's TP size and KV cache, or the transformers batch."""
    s = c.setting
    rollout["backend"] = s.generation_engine  # (the run's own where it names one: the search weighed only it)
    vllm = rollout.setdefault("vllm", {})
    vllm["tensor_parallel_size"] = s.tensor_parallel
    if s.generation_engine == "vllm":
        vllm["kv_cache_gb"] = kv_cache_gb(c)
        rollout.pop("generate_batch_size", None)
    else:
        rollout["generate_batch_size"] = c.estimate.generate_batch


def write_config(cfg, c: Candidate, path: Path, cpus_per_node: int | None = None) -> None:
    import yaml

    from toolkit.config.load import validate

    data = as_config(cfg, c, cpus_per_node)
    s = c.setting
    validate(data, base_dir=path.resolve().parent, source=path)  # refuse to write what would not load
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}"  # (whole or not at all)
    try:
        tmp.write_text(f"# written by slurm-rlhf plan: {s.strategy}, {s.describe()}\n"
                       + yaml.safe_dump(data, sort_keys=False))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def setting_of(cfg) -> Layout:
    """The setting a run config already asks for (to predict its step time)."""
    from toolkit.placement.plan import plan

    groups = tuple(Group(g.name, g.models, g.nodes, g.workers, g.gpus_per_worker, g.same_nodes_as) for g in plan(cfg))
    tp = cfg.rollout.vllm.tensor_parallel_size if any(g.own_engine for g in groups) else 1  # (the actor's: whole)
    return Layout(cfg.placement.strategy, groups, cfg.trainer.zero_stage, cfg.trainer.micro_batch_size, tp,
                  cfg.generation_backend, cfg.placement.offload)
