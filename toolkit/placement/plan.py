"""The placement plan: worker groups (one per node group), each hosting one or more roles.

Models map to roles: generation -> generator, reference -> reference, reward -> reward (every reward
function and reward model), actor and critic -> trainer. A critic in a node group of its own runs
trainer ranks too (ranks after the actor's, each paired with one of them), so the trainer's ranks may
span two groups: `trainer_groups`. A step's samples pass the roles in `stages`
order: the generator first, the trainer last, the scoring roles in between, ordered so that samples
change worker as seldom as possible (a role hosted with the generator runs right after it, on the
same worker, in memory). Roles of one worker hand samples over in memory; otherwise a worker sends them
to the group that hosts the next stage.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

ROLE_OF = {"generation": "generator", "reference": "reference", "reward": "reward", "actor": "trainer",
           "critic": "trainer"}
SCORING = ("reference", "reward")


@functools.lru_cache(maxsize=256)
def several_roles(models: tuple[str, ...]) -> bool:
    """Whether a node group hosting `models` runs more than one role (where `placement.offload` acts)."""
    return len({ROLE_OF[m] for m in models}) > 1


@dataclass(frozen=True)
class WorkerGroup:
    """One kind of worker on its own node group (under Slurm: one job step on its own nodes)."""

    name: str
    roles: tuple[str, ...]
    workers: int
    cpus_per_worker: int | None = None
    gpus_per_worker: int = 0
    env: dict = field(default_factory=dict)
    nodes: int = 1
    mem_gb: float | None = None
    partition: str | None = None
    constraint: str | None = None
    models: tuple[str, ...] = ()
    same_nodes_as: str | None = None  # (Slurm: the group whose nodes this one shares)

    @property
    def tasks_per_node(self) -> int:
        return self.workers // self.nodes

    def worker_ids(self) -> list[str]:
        return [f"{self.name}:{rank}" for rank in range(self.workers)]

    def receives(self, role: str) -> bool:
        """Whether samples for `role` arriving from another group go to every rank (else to rank 0).
        Trainer ranks above 0 spend the step in the trainer's collectives, so a group hosting the
        trainer takes samples on rank 0 only; prompts reach every generator."""
        return role == "generator" or "trainer" not in self.roles


def plan(cfg) -> list[WorkerGroup]:
    """Worker groups of the config's placement, in allocation order. A supervised stage (sft, rm) has one
    group, whose role is the stage itself, training its one model (the `trainee`)."""
    groups = []
    for name, models, s in cfg.placement.layout():
        models = tuple(m for m in models if cfg.hosts(m))  # only PPO has a critic
        roles = tuple(dict.fromkeys(cfg.stage if m == "trainee" else ROLE_OF[m] for m in models))
        groups.append(WorkerGroup(name, roles, s.workers, s.cpus_per_worker, s.gpus_per_worker, dict(s.env),
                                  s.nodes, s.mem_gb, s.partition or cfg.slurm.partition, s.constraint, tuple(models),
                                  s.same_nodes_as))
    return groups


def group_of(groups: list[WorkerGroup], role: str) -> WorkerGroup:
    """The group hosting `role`; for the trainer, the actor's group (its rank 0 is the trainer's rank 0)."""
    return trainer_groups(groups)[0] if role == "trainer" else next(g for g in groups if role in g.roles)


def trainer_groups(groups: list[WorkerGroup]) -> list[WorkerGroup]:
    """The groups of the trainer's ranks in rank order: the actor's, then a critic's group of its own."""
    hosts = [g for g in groups if "trainer" in g.roles]
    return sorted(hosts, key=lambda g: "actor" not in g.models)


def stages(groups: list[WorkerGroup]) -> tuple[str, ...]:
    """The order in which samples pass the roles (see the module docstring)."""
    order = ["generator"]
    left = [role for role in SCORING if any(role in g.roles for g in groups)]  # (LoRA: no reference role)
    here = group_of(groups, "generator")
    trainer = group_of(groups, "trainer")
    while left:
        role = next((r for r in left if group_of(groups, r) == here), None)
        if role is None:  # move on: first to groups without the trainer, the trainer's group last
            role = next((r for r in left if group_of(groups, r) != trainer), left[0])
            here = group_of(groups, role)
        order.append(role)
        left.remove(role)
    return (*order, "trainer")


def next_stage(groups: list[WorkerGroup], role: str) -> str | None:
    order = stages(groups)
    i = order.index(role)
    return order[i + 1] if i + 1 < len(order) else None

