"""Placement strategies: which group hosts which role, the order samples pass the roles, and config errors."""

from __future__ import annotations

import pytest

from tests.conftest import example, write_config
from toolkit.config import load_config
from toolkit.errors import ConfigError
from toolkit.placement.plan import group_of, plan, stages, trainer_groups


def cfg_of(tiny, tmp_path, algorithm="ppo", **placement):
    name = "tiny-ppo.yaml" if algorithm == "ppo" else "tiny-grpo.yaml"
    return load_config(write_config(tmp_path, example(name, tiny, placement=placement)))


@pytest.mark.parametrize("strategy, groups, order", [
    ("separation", {"generator": ("generator",), "scorer": ("reference", "reward"), "trainer": ("trainer",)},
     ("generator", "reference", "reward", "trainer")),
    ("flattening", {"all": ("generator", "reference", "reward", "trainer")},
     ("generator", "reference", "reward", "trainer")),
    ("interleaving", {"trainer": ("trainer", "generator"), "scorer": ("reference", "reward")},
     ("generator", "reference", "reward", "trainer")),
    # The reference sits with the trainer: the reward (elsewhere) runs first; the reference's stage is on trainer
    # rank 0, and every trainer rank scores its shard in the training step (the scoring roles' `deferred`).
    ("colocate_actor_ref", {"generator": ("generator",), "reward": ("reward",), "trainer": ("trainer", "reference")},
     ("generator", "reward", "reference", "trainer")),
    ("colocate_critic_reward", {"generator": ("generator",), "reference": ("reference",),
                                "trainer": ("trainer", "reward")},
     ("generator", "reference", "reward", "trainer")),
    ("colocate_all_models", {"generator": ("generator",), "trainer": ("trainer", "reference", "reward")},
     ("generator", "reference", "reward", "trainer")),
])
def test_presets(strategy, groups, order, tiny, tmp_path):
    planned = plan(cfg_of(tiny, tmp_path, strategy=strategy))
    assert {g.name: g.roles for g in planned} == groups
    assert stages(planned) == order


def test_custom_layout_and_receivers(tiny, tmp_path):
    """A scoring role hosted with the generator runs right after it, before one in another group."""
    planned = plan(cfg_of(tiny, tmp_path, strategy="custom",
                          gen={"models": ["generation", "reward"], "workers": 2},
                          train={"models": ["actor", "critic", "reference"], "workers": 2}))
    assert stages(planned) == ("generator", "reward", "reference", "trainer")
    gen, train = group_of(planned, "generator"), group_of(planned, "trainer")
    assert gen.receives("generator") and gen.receives("reward")      # prompts and samples reach every rank
    assert not train.receives("reference") and not train.receives("trainer")  # rank 0 only


def test_grpo_places_no_critic(tiny, tmp_path):
    planned = plan(cfg_of(tiny, tmp_path, algorithm="grpo", strategy="interleaving"))
    assert group_of(planned, "trainer").models == ("actor", "generation")
    data = example("tiny-grpo.yaml", tiny, placement={
        "strategy": "custom", "gen": {"models": ["generation", "reference", "reward"]}, "train": {"models": ["actor"]},
        "critic": {"models": ["critic"]}})
    assert ("placement.critic hosts the critic, but run.algorithm grpo has none (only ppo); remove that node group"
            in error_of(tiny, tmp_path, data))


def test_the_critic_on_ranks_of_its_own(tiny, tmp_path):
    """The critic's node group runs trainer ranks after the actor's; samples still go to the actor's rank 0."""
    planned = plan(cfg_of(tiny, tmp_path, strategy="custom", critic={"models": ["critic"], "workers": 2},
                          gen={"models": ["generation", "reference", "reward"]},
                          train={"models": ["actor"], "workers": 2}))
    assert [g.name for g in trainer_groups(planned)] == ["train", "critic"]  # (rank order: the actor's first)
    assert group_of(planned, "trainer").name == "train"
    assert stages(planned) == ("generator", "reference", "reward", "trainer")
    data = example("tiny-ppo.yaml", tiny, trainer={"zero_stage": 3}, placement={
        "strategy": "custom", "gen": {"models": ["generation", "reference", "reward"]}, "train": {"models": ["actor"]},
        "critic": {"models": ["critic"]}})
    assert load_config(write_config(tmp_path, data)).trainer.zero_stage == 3  # (each part shards over its own ranks)


def test_a_lost_worker_of_a_shared_group_is_named_with_its_roles(tiny, tmp_path):
    """The driver's error for a worker that died names its roles where its group's name does not say them: a
    Flattening worker said only `all worker rank 0 (all:0, pid ... on node vm) exited with signal SIGKILL`."""
    from types import SimpleNamespace

    from toolkit.launch.supervisor import Supervisor

    def describe(strategy: str, worker_id: str) -> str:
        driver = SimpleNamespace(groups=plan(cfg_of(tiny, tmp_path, strategy=strategy)),
                                 book={worker_id: {"pid": 12507, "node": "vm"}})
        return Supervisor._describe(driver, worker_id)

    assert describe("flattening", "all:0") == ("all worker rank 0 (all:0, pid 12507 on node vm; roles generator, "
                                               "reference, reward, trainer)")
    assert describe("colocate_all_models", "trainer:0") == ("trainer worker rank 0 (trainer:0, pid 12507 on node vm; "
                                                            "roles trainer, reference, reward)")
    assert describe("separation", "trainer:0") == "trainer worker rank 0 (trainer:0, pid 12507 on node vm)"


def error_of(tiny, tmp_path, data) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(write_config(tmp_path, data))
    assert info.value.exit_code == 2
    return str(info.value)


@pytest.mark.parametrize("placement, message", [
    ({"strategy": "interleaving", "generator": {"workers": 2}},
     "unknown node group 'generator': strategy interleaving has node groups trainer, scorer"),
    ({"strategy": "custom", "a": {"models": ["generation", "actor", "critic"]},
      "b": {"models": ["reference", "reward", "actor"]}},
     "node groups overlap: actor is in placement.a.models and placement.b.models; put every model in exactly one "
     "group"),
    ({"strategy": "custom", "a": {"models": ["generation", "actor", "critic"]}, "b": {"models": ["reward"]}},
     "no node group hosts reference"),
    ({"strategy": "custom", "a": {"models": ["generation", "actor", "reference"]},
      "b": {"models": ["critic", "reward"]}}, "b.models: the critic in a node group apart from the actor's (a) "
                                              "trains on trainer ranks of its own, so that group hosts the critic "
                                              "alone; move reward to another group"),
    ({"strategy": "custom", "a": {"models": ["generation", "reference", "reward"]},
      "t": {"models": ["actor"], "workers": 2}, "c": {"models": ["critic"]}},
     "placement.c.workers is 1, but the actor's group t has 2: each critic rank pairs with an actor rank"),
    ({"strategy": "flattening", "all": {"models": ["actor"]}}, "all.models is only for strategy custom"),
    ({"strategy": "custom", "a": {"models": ["generation", "actor", "critic", "reference", "rewards"]}},
     "placement.a.models.4: got 'rewards': input should be 'generation', 'reference', 'reward', 'actor' or 'critic'"),
    ({"strategy": "custom"}, "strategy custom needs node groups"),
])
def test_impossible_placements(placement, message, tiny, tmp_path):
    assert message in error_of(tiny, tmp_path, example("tiny-ppo.yaml", tiny, placement=placement))


def test_overlapping_groups_point_at_a_models_line_not_the_placement_line(tiny, tmp_path):
    placement = {"strategy": "custom", "a": {"models": ["generation", "actor", "critic"]},
                 "b": {"models": ["reference", "reward", "actor"]}}
    path = write_config(tmp_path, example("tiny-ppo.yaml", tiny, placement=placement))
    lines = path.read_text().splitlines()
    placement_line = lines.index("placement:") + 1
    models_line = next(i for i, line in enumerate(lines, 1) if i > placement_line and "models" in line)
    with pytest.raises(ConfigError, match=f"{path}:{models_line}: placement: node groups overlap"):
        load_config(path)


def test_placement_against_resources(tiny, tmp_path):
    data = example("tiny-grpo.yaml", tiny, placement={"trainer": {"workers": 2, "nodes": 2}}, slurm={"nodes": 3},
                   trainer={"micro_batch_size": 8})
    assert "the node groups need 4 nodes (generator 1, scorer 1, trainer 2) but slurm.nodes allows 3" in \
        error_of(tiny, tmp_path, data)
    data = example("tiny-grpo.yaml", tiny, placement={"generator": {"gpus_per_worker": 3}},
                   rollout={"vllm": {"tensor_parallel_size": 2}})
    assert "rollout.vllm.tensor_parallel_size (2) does not divide the GPUs of each generator worker (3)" in \
        error_of(tiny, tmp_path, data)
    data = example("tiny-grpo.yaml", tiny, placement={"generator": {"cpus_per_worker": 1}},
                   rollout={"backend": "vllm", "vllm": {"tensor_parallel_size": 2}})
    assert ("rollout.vllm.tensor_parallel_size (2) is more than the CPUs of each generator worker (1); on CPUs each "
            "rank needs one of its own: give placement.generator.cpus_per_worker at least 2") in error_of(tiny, tmp_path, data)
    for workers in (1, 2):  # (vLLM in each trainer rank's process)
        data = example("tiny-grpo.yaml", tiny, placement={"strategy": "flattening", "all": {"workers": workers}},
                       rollout={"backend": "vllm"})
        assert load_config(write_config(tmp_path, data)).generation_backend == "vllm"
    data = example("tiny-grpo.yaml", tiny, placement={"generator": {"workers": 32}})
    assert "prompts_per_step (16) is less than the generator workers (32)" in error_of(tiny, tmp_path, data)


def test_asynchronous_mode_needs_generators_of_their_own(tiny, tmp_path):
    for strategy in ("flattening", "interleaving"):
        data = example("tiny-grpo.yaml", tiny, placement={"strategy": strategy}, rollout={"max_policy_lag": 1})
        assert f"rollout.max_policy_lag is 1 (asynchronous mode), but placement.strategy {strategy} puts generation " \
               "in the trainer's workers" in error_of(tiny, tmp_path, data)
    data = example("tiny-grpo.yaml", tiny, placement={"generator": {"workers": 2}},
                   rollout={"max_policy_lag": 3}, transport={"max_inflight_messages": 8})
    assert "transport.max_inflight_messages (8) is less than the messages of the steps in flight with " \
           "rollout.max_policy_lag 3 and 2 generator worker(s): (lag + 2) x workers = 10" in \
        error_of(tiny, tmp_path, data)
    data = example("tiny-grpo.yaml", tiny, rollout={"max_policy_lag": -1})
    assert "rollout.max_policy_lag" in error_of(tiny, tmp_path, data)
    cfg = load_config(write_config(tmp_path, example("tiny-grpo.yaml", tiny, placement={"strategy": "colocate_all_models"},
                                                     rollout={"max_policy_lag": 2})))
    assert cfg.behaviour_correction  # auto: on when asynchronous
    assert not load_config(write_config(tmp_path, example("tiny-grpo.yaml", tiny))).behaviour_correction


def test_asynchronous_mode_counts_the_parts_a_streaming_generator_sends(tiny, tmp_path):
    """With rollout.stream_groups a generator sends a step in parts, up to one per `stream_groups` prompt groups
    of its share. Asynchronously the trainer reads none while it trains and sends the weights on, which wait
    for the generators: a run of 64 prompts a step in parts of 1 group with max_inflight_messages 3 (allowed
    before: (1 + 2) x 1 generator) stood still, the generator in its send of step 2's parts, the trainer in
    the weight sync after step 1, until step_timeout_s."""
    data = example("tiny-grpo.yaml", tiny, rollout={"max_policy_lag": 1, "backend": "vllm", "stream_groups": 1,
                                                     "prompts_per_step": 64}, transport={"max_inflight_messages": 3})
    assert ("transport.max_inflight_messages (3) is less than the messages of the steps in flight with "
            "rollout.max_policy_lag 1 and 1 generator worker(s): (lag + 2) x workers x 64 parts of a generator's "
            "step (rollout.stream_groups 1 of its 64 prompt groups) = 192; raise it, or raise rollout.stream_groups "
            "(0: one message a step)") in error_of(tiny, tmp_path, data)
    data = example("tiny-grpo.yaml", tiny, placement={"generator": {"workers": 2}},
                   rollout={"max_policy_lag": 1, "backend": "vllm", "stream_groups": 3},
                   transport={"max_inflight_messages": 17})  # (8 groups each: parts of at least 3, 3 a step)
    assert "(lag + 2) x workers x 3 parts of a generator's step (rollout.stream_groups 3 of its 8 prompt " \
           "groups) = 18" in error_of(tiny, tmp_path, data)
    data["transport"]["max_inflight_messages"] = 18
    assert load_config(write_config(tmp_path, data)).transport.max_inflight_messages == 18
    data["rollout"].update(backend="hf")  # (transformers sends a step in one message)
    data["transport"]["max_inflight_messages"] = 6
    assert load_config(write_config(tmp_path, data)).rollout.stream_groups == 3


def test_tensor_parallel_ranks_on_cpus_get_cpus_of_their_own():
    """vLLM on CPU binds each tensor-parallel rank's threads to one NUMA node each unless told which CPUs
    to take: a generator worker shares its CPUs among its ranks, and one left over stays unbound."""
    from toolkit.roles.engines.vllm_engine import cpu_binding

    assert cpu_binding(2, [0, 1]) == "0|1"
    assert cpu_binding(2, [4, 5, 6, 7, 9]) == "4,5|6,7"
    with pytest.raises(RuntimeError, match=r"tensor_parallel_size is 4, but this generator worker may use 3 CPU\(s\) "
                                           r"\(0, 1, 2\).*cpus_per_worker at least 4"):
        cpu_binding(4, [0, 1, 2])
