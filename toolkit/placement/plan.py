"""The placement plan: worker groups (one per node group), each hosting one or more roles.

Data flows through the roles in PIPELINE order. A worker sends its output to the group that hosts the
role after its own last role; roles inside one worker would hand data over in memory.
"""

from __future__ import annotations

from dataclasses import dataclass, field

PIPELINE = ("generator", "scorer", "trainer")


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

    @property
    def tasks_per_node(self) -> int:
        return self.workers // self.nodes

    def worker_ids(self) -> list[str]:
        return [f"{self.name}:{rank}" for rank in range(self.workers)]

    @property
    def receives_on_every_rank(self) -> bool:
        """Generators and scorers share incoming work across ranks; a trainer receives on rank 0 only."""
        return PIPELINE.index(self.roles[0]) < PIPELINE.index("trainer")


def plan(cfg) -> list[WorkerGroup]:
    """Worker groups for the config's placement (separation: one group per role)."""
    groups = []
    for role in PIPELINE:
        s = getattr(cfg.placement, role)
        groups.append(WorkerGroup(role, (role,), s.workers, s.cpus_per_worker, s.gpus_per_worker, dict(s.env),
                                  s.nodes, s.mem_gb, s.partition or cfg.slurm.partition, s.constraint))
    return groups


def group_of(groups: list[WorkerGroup], role: str) -> WorkerGroup:
    return next(g for g in groups if role in g.roles)


def next_group(groups: list[WorkerGroup], group: WorkerGroup) -> WorkerGroup | None:
    """The group that receives this group's output (None for the last stage)."""
    last = max(PIPELINE.index(r) for r in group.roles)
    if last + 1 == len(PIPELINE):
        return None
    return group_of(groups, PIPELINE[last + 1])
