"""The Slurm allocation a placement needs: one job, or a heterogeneous job of one component per node group.

Pure: no Slurm is needed to plan, so `submit --dry-run` and `render` work anywhere. A component lists its
node groups in pipeline order; inside the allocation each group gets its own disjoint slice of its
component's nodes (`assign_nodes`).
"""

from __future__ import annotations

from dataclasses import dataclass

from toolkit.errors import ConfigError
from toolkit.placement.plan import WorkerGroup
from toolkit.table import text_table


@dataclass(frozen=True)
class Component:
    """One part of a (heterogeneous) Slurm job: the same resources on each of its nodes."""

    groups: tuple[WorkerGroup, ...]
    tasks_per_node: int
    cpus_per_task: int | None
    gpus_per_task: int
    mem_gb: float | None
    partition: str | None
    constraint: str | None

    @property
    def nodes(self) -> int:
        return sum(g.nodes for g in self.groups)


@dataclass(frozen=True)
class Allocation:
    components: tuple[Component, ...]

    @property
    def heterogeneous(self) -> bool:
        return len(self.components) > 1

    @property
    def nodes(self) -> int:
        return sum(c.nodes for c in self.components)

    def component_of(self, group: WorkerGroup) -> int:
        return next(i for i, c in enumerate(self.components) if group in c.groups)


def plan_allocation(groups: list[WorkerGroup], heterogeneous: str = "auto") -> Allocation:
    """The allocation for `groups` (`heterogeneous`: auto, always or never; see SlurmSection)."""
    apart = {(g.partition, g.constraint, g.gpus_per_worker) for g in groups}
    if heterogeneous == "never" and len({(g.partition, g.constraint) for g in groups}) > 1:
        where = ", ".join(f"{g.name}: partition {g.partition or '(default)'}, constraint {g.constraint or '-'}"
                          for g in groups)
        raise ConfigError(f"slurm.heterogeneous is 'never' but the node groups need different partitions or "
                          f"node features ({where}); allow a heterogeneous job or give them the same")
    if heterogeneous == "always" or (heterogeneous == "auto" and len(apart) > 1):
        return Allocation(tuple(_component((g,)) for g in groups))
    return Allocation((_component(tuple(groups)),))


def _component(groups: tuple[WorkerGroup, ...]) -> Component:
    """Resources per node: the most any of its groups needs."""
    cpus = [g.cpus_per_worker for g in groups if g.cpus_per_worker]
    mems = [g.mem_gb for g in groups if g.mem_gb]
    return Component(groups, max(g.tasks_per_node for g in groups), max(cpus) if cpus else None,
                     max(g.gpus_per_worker for g in groups), max(mems) if mems else None,
                     groups[0].partition, groups[0].constraint)


def assign_nodes(allocation: Allocation, component_nodes: list[list[str]]) -> dict[str, list[str]]:
    """{group name: its nodes}: each component's nodes cut in order into its groups' disjoint slices."""
    if len(component_nodes) != len(allocation.components):
        raise RuntimeError(f"the job has {len(component_nodes)} components, the plan {len(allocation.components)}")
    out = {}
    for component, nodes in zip(allocation.components, component_nodes):
        if len(nodes) < component.nodes:
            raise RuntimeError(f"a job component has {len(nodes)} nodes ({','.join(nodes)}); "
                               f"its node groups need {component.nodes}")
        start = 0
        for g in component.groups:
            out[g.name] = nodes[start: start + g.nodes]
            start += g.nodes
    return out


def placement_table(groups: list[WorkerGroup], allocation: Allocation) -> str:
    """The plan as a table: node group, models, nodes, tasks, CPUs, GPUs, memory, partition, job component."""
    rows = [("node group", "models", "nodes", "tasks", "CPUs/task", "GPUs/task", "mem/node", "partition", "component")]
    for g in groups:
        rows.append((g.name, ",".join(g.models), str(g.nodes), str(g.workers), str(g.cpus_per_worker or "-"),
                     str(g.gpus_per_worker), f"{g.mem_gb:g}G" if g.mem_gb else "-", g.partition or "(default)",
                     str(allocation.component_of(g)) if allocation.heterogeneous else "-"))
    return text_table(rows)
