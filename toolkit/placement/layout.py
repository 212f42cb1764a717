"""A layout: which node group hosts which models, on how many nodes and workers, and how the trainer and
the generator are parallelised. The config (placement presets, the checks of what a layout allows), the
planner, the cost model and the launcher all read it from here: this is the one place that says what a
layout means.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

# What a placement puts somewhere: the generation engine, the reference model, the rewards (functions
# and reward models), the actor and the critic (PPO).
MODELS = ("generation", "reference", "reward", "actor", "critic")

# Node groups of each preset placement (the order is the order of the node groups in the allocation).
PRESETS: dict[str, dict[str, tuple[str, ...]]] = {
    "separation": {"generator": ("generation",), "scorer": ("reference", "reward"), "trainer": ("actor", "critic")},
    "flattening": {"all": MODELS},
    "interleaving": {"trainer": ("actor", "critic", "generation"), "scorer": ("reference", "reward")},
    "colocate_actor_ref": {"generator": ("generation",), "reward": ("reward",),
                           "trainer": ("actor", "critic", "reference")},
    "colocate_critic_reward": {"generator": ("generation",), "reference": ("reference",),
                               "trainer": ("actor", "critic", "reward")},
    "colocate_all_models": {"generator": ("generation",), "trainer": ("actor", "critic", "reference", "reward")},
}


def generates_with_actor(models: Iterable[str]) -> bool:
    """Whether a group hosting `models` generates with the actor itself (the trainer's own weights, no
    engine of its own and no weight sync), rather than with an engine (vLLM) of its own."""
    models = tuple(models)
    return "generation" in models and "actor" in models


def on_trainer_ranks(models: Iterable[str], scorer: str) -> bool:
    """Whether a group hosting `models` runs the scoring model `scorer` ("reference", or "reward": its reward
    models) on its trainer ranks, inside the training step, each rank its own shard of the step (`deferred`
    of the scoring roles): the scorer sits with the actor. (In a group that does not generate, samples
    arrive at trainer rank 0 alone; in one that generates with the actor, each rank would score what it
    generated, at its own time.) Every rank scores at once there, so under ZeRO-3 the model is sharded over
    those ranks, as DeepSpeed-Chat and OpenRLHF shard theirs."""
    models = tuple(models)
    return scorer in models and "actor" in models


def scored_in_training_step(models: Iterable[str], scorer: str, workers: int) -> bool:
    """Whether a group hosting `models` on `workers` workers scores with `scorer` inside the training step,
    every trainer rank its shard (the scoring roles' `deferred`): `on_trainer_ranks`, in a group of several
    ranks. With one, scoring each message on arrival overlaps the wait for the rest of the step."""
    return on_trainer_ranks(models, scorer) and workers > 1


def generation_with_actor(groups: Iterable[Iterable[str]]) -> bool:
    """Whether, of groups hosting these models each, the one that generates is the actor's."""
    return any(generates_with_actor(models) for models in groups)


@dataclass(frozen=True)
class Group:
    """One node group: its models, nodes, workers and GPUs per worker (a vLLM engine's TP size), and the
    group whose nodes it shares (`same_nodes_as`: some GPUs of each of that group's nodes are its own)."""

    name: str
    models: tuple[str, ...]
    nodes: int = 1
    workers: int = 1
    gpus_per_worker: int = 0
    same_nodes_as: str | None = None

    @property
    def tasks_per_node(self) -> int:
        """Workers on each of its nodes (as a config's group: `WorkerGroup.tasks_per_node`)."""
        return self.workers // self.nodes

    @property
    def trains(self) -> tuple[str, ...]:
        """The models this group trains: the actor (and the critic beside it), or a critic on ranks of its own."""
        return tuple(m for m in ("actor", "critic") if m in self.models)

    @property
    def own_engine(self) -> bool:
        """Whether this group generates with an engine of its own."""
        return "generation" in self.models and not generates_with_actor(self.models)

    def describe(self) -> str:
        nodes = f"{self.nodes}n of {self.same_nodes_as}" if self.same_nodes_as else f"{self.nodes}n"
        return f"{self.name}[{','.join(self.models)}] {nodes} x{self.workers}"


@dataclass(frozen=True)
class Layout:
    """A whole layout as the planner weighs it: the groups, the trainer's ZeRO stage and micro-batch,
    the generator's TP size and engine, and whether a group of several roles moves what the phase that
    runs does not need to host memory (`placement.offload`)."""

    strategy: str
    groups: tuple[Group, ...]
    zero_stage: int
    micro_batch: int
    tensor_parallel: int = 1
    generation_engine: str = "vllm"    # vllm, or hf (transformers `generate`, as where generation shares the actor)
    offload: bool = False              # placement.offload

    def group(self, model: str) -> Group:
        return next(g for g in self.groups if model in g.models)

    def workers(self, model: str) -> int:
        return self.group(model).workers

    def together(self, a: str, b: str) -> bool:
        return self.group(a) == self.group(b)

    def same_nodes(self, a: str, b: str) -> bool:
        """Whether the groups of models `a` and `b` run on the same nodes (one group, or one on the other's)."""
        ga, gb = self.group(a), self.group(b)
        return ga == gb or ga.same_nodes_as == gb.name or gb.same_nodes_as == ga.name

    @property
    def generation_with_actor(self) -> bool:
        return generation_with_actor(g.models for g in self.groups)

    @property
    def trainers(self) -> tuple[Group, ...]:
        """The groups that train: the actor's, then a critic's group of its own (trainer ranks after the
        actor's, each paired with one of them)."""
        return tuple(sorted((g for g in self.groups if g.trains), key=lambda g: "actor" not in g.models))

    @property
    def critic_apart(self) -> bool:
        """Whether the critic trains on ranks of its own, in a group apart from the actor's."""
        return len(self.trainers) > 1

    def describe(self) -> str:
        return " | ".join(g.describe() for g in self.groups)
