"""The placement plan: worker groups (one per node group), each hosting one or more roles.

Data flows through the roles in PIPELINE order. A worker sends its output to the group that hosts the
role after its own last role; roles inside one worker would hand data over in memory.
"""

from __future__ import annotations

from dataclasses import dataclass, field

PIPELINE = ("generator", "scorer", "trainer")


@dataclass(frozen=True)
class WorkerGroup:
    name: str
    roles: tuple[str, ...]
    workers: int
    cpus_per_worker: int | None = None
    gpus_per_worker: int = 0
    env: dict = field(default_factory=dict)

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
        section = getattr(cfg.placement, role)
        groups.append(WorkerGroup(role, (role,), section.workers, section.cpus_per_worker,
                                  section.gpus_per_worker, dict(section.env)))
    return groups


def group_of(groups: list[WorkerGroup], role: str) -> WorkerGroup:
    return next(g for g in groups if role in g.roles)


def next_group(groups: list[WorkerGroup], group: WorkerGroup) -> WorkerGroup | None:
    """The group that receives this group's output (None for the last stage)."""
    last = max(PIPELINE.index(r) for r in group.roles)
    if last + 1 == len(PIPELINE):
        return None
    return group_of(groups, PIPELINE[last + 1])
