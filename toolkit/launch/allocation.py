"""The Slurm allocation a placement needs: one job, or a heterogeneous job of one component per node group.

Pure: no Slurm is needed to plan, so `submit --dry-run` and `render` work anywhere. A component lists its
node groups in pipeline order; inside the allocation each group gets its own disjoint slice of its
component's nodes (`assign_nodes`), except a group with `same_nodes_as`, which gets the nodes of the group
it names: a node set of several groups, whose tasks and GPUs per node add up.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from toolkit.errors import ConfigError
from toolkit.placement.plan import WorkerGroup
from toolkit.table import text_table


def mem_option(gb: float) -> str:
    """Slurm's --mem value for `gb` GiB: whole GiB as `16G`, a fraction in MiB (Slurm takes whole numbers)."""
    return f"{int(gb)}G" if gb == int(gb) else f"{math.ceil(gb * 1024)}M"


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
    gpus_per_node: int | None = None  # (instead of gpus_per_task: groups with different GPUs share nodes)

    @property
    def nodes(self) -> int:
        return sum(g.nodes for g in self.groups if g.same_nodes_as is None)


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


def node_sets(groups: list[WorkerGroup]) -> list[tuple[WorkerGroup, ...]]:
    """The groups that run on the same nodes: each group without `same_nodes_as`, with those that name it."""
    return [(host, *(g for g in groups if g.same_nodes_as == host.name)) for host in groups
            if host.same_nodes_as is None]


def plan_allocation(groups: list[WorkerGroup], heterogeneous: str = "auto") -> Allocation:
    """The allocation for `groups` (`heterogeneous`: auto, always or never; see SlurmSection). Groups on the
    same nodes are always in one component."""
    sets = node_sets(groups)
    # (memory too: one job's --mem holds on each of its nodes, so a group's mem_gb capped the nodes of
    # groups that asked for none, their partition's default, and trainer nodes were killed for memory)
    apart = {(s[0].partition, s[0].constraint, frozenset(g.gpus_per_worker for g in s), _memory(s)) for s in sets}
    if heterogeneous == "never" and len({(g.partition, g.constraint) for g in groups}) > 1:
        where = ", ".join(f"{g.name}: partition {g.partition or '(default)'}, constraint {g.constraint or '-'}"
                          for g in groups)
        raise ConfigError(f"slurm.heterogeneous is 'never' but the node groups need different partitions or "
                          f"node features ({where}); allow a heterogeneous job or give them the same")
    if heterogeneous == "never" and None in {_memory(s) for s in sets} and any(_memory(s) for s in sets):
        asked = ", ".join(f"{g.name} {g.mem_gb:g}" for g in groups if g.mem_gb)
        others = ", ".join(s[0].name for s in sets if not _memory(s))
        raise ConfigError(f"slurm.heterogeneous is 'never', so every node of the job gets the same memory, but "
                          f"placement.<group>.mem_gb is set for {asked} and not for {others} (their partition's "
                          "default); give those groups mem_gb too, or allow a heterogeneous job")
    if heterogeneous == "always" or (heterogeneous == "auto" and len(apart) > 1):
        return Allocation(tuple(_component(s) for s in sets))
    return Allocation((_component(tuple(groups)),))


def _memory(node_set: tuple[WorkerGroup, ...]) -> float | None:
    """GB per node that the groups of a node set ask for together; None: none asks (the partition's default)."""
    return sum(g.mem_gb for g in node_set if g.mem_gb) or None


def _component(groups: tuple[WorkerGroup, ...]) -> Component:
    """Resources per node: the most any of its node sets needs (the groups of a set add up)."""
    sets = node_sets(list(groups))
    cpus = [g.cpus_per_worker for g in groups if g.cpus_per_worker]
    mems = [_memory(s) or 0 for s in sets]
    gpus = {g.gpus_per_worker for g in groups}
    shared = any(len(s) > 1 for s in sets)
    return Component(groups, max(sum(g.tasks_per_node for g in s) for s in sets), max(cpus) if cpus else None,
                     max(gpus), max(mems) or None, groups[0].partition, groups[0].constraint,
                     max(sum(g.tasks_per_node * g.gpus_per_worker for g in s) for s in sets)
                     if shared and len(gpus) > 1 else None)


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
            if g.same_nodes_as is None:
                out[g.name] = nodes[start: start + g.nodes]
                start += g.nodes
        for g in component.groups:
            if g.same_nodes_as is not None:
                out[g.name] = out[g.same_nodes_as]
    return out


def shares_nodes(group: WorkerGroup, groups) -> bool:
    """Whether another group runs on this group's nodes (each job step then takes only what it asks for)."""
    return group.same_nodes_as is not None or any(g.same_nodes_as == group.name for g in groups)


def step_mem_mb(group: WorkerGroup, groups, job_mem_mb: int | None) -> int | None:
    """Slurm's --mem (MiB per node) for the job step of `group`, where other groups share its nodes and none of
    them sets `mem_gb`, but the job has memory per node (`job_mem_mb`, SLURM_MEM_PER_NODE: a cluster's or
    partition's DefMemPerNode, or sbatch's SBATCH_MEM_PER_NODE): where Slurm counts memory, a step that asks
    for none takes all the job's memory on its nodes, and the other group's step waited for it (srun:
    'Cancelled pending job step') until the run's start-up timed out. Each group of the node set gets the
    job's memory in proportion to the CPUs its workers take there. None: the group asks for its own
    (`mem_gb`), or the job has memory per CPU or none counted (Slurm gives a step its CPUs' share then)."""
    if group.mem_gb or not job_mem_mb:
        return None
    home = group.same_nodes_as or group.name
    node_set = [g for g in groups if home in (g.name, g.same_nodes_as)]
    cpus = {g.name: g.tasks_per_node * (g.cpus_per_worker or 1) for g in node_set}
    return max(1, job_mem_mb * cpus[group.name] // sum(cpus.values()))


def placement_table(groups: list[WorkerGroup], allocation: Allocation) -> str:
    """The plan as a table: node group, models, nodes, tasks, CPUs, GPUs, memory, partition, job component."""
    rows = [("node group", "models", "nodes", "tasks", "CPUs/task", "GPUs/task", "mem/node", "partition", "component")]
    for g in groups:
        nodes = f"{g.nodes} ({g.same_nodes_as}'s)" if g.same_nodes_as else str(g.nodes)
        rows.append((g.name, ",".join(g.models), nodes, str(g.workers), str(g.cpus_per_worker or "-"),
                     str(g.gpus_per_worker), f"{g.mem_gb:g}G" if g.mem_gb else "-", g.partition or "(default)",
                     str(allocation.component_of(g)) if allocation.heterogeneous else "-"))
    return text_table(rows)
