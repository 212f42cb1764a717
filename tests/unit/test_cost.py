"""The planner's memory and time model on cases computed by hand, and its search."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
import yaml

from tests.conftest import REPO, cli, example, write_config
from toolkit.config import load_config
from toolkit.placement.cluster import Cluster, load_cluster
from toolkit.errors import ConfigError
from toolkit.placement.cost import ModelShape, Switches, Workload, estimate, remedy, trainer_memory
from toolkit.placement.layout import PRESETS, Group, Layout
from toolkit.placement.plan import plan
from toolkit.placement.planner import node_counts, search, setting_of, workload_of

CLUSTERS = REPO / "templates" / "clusters"


def test_shape_counts_the_tiny_model_exactly(tiny):
    from transformers import AutoModelForCausalLM

    shape = ModelShape.from_config(tiny / "model")
    # 2 layers x (attention 4 x 128 x 128, MLP 3 x 128 x 256, 2 norms) + untied 512 x 128 embeddings x 2 + norm
    assert shape.params == 2 * (4 * 128 * 128 + 3 * 128 * 256 + 2 * 128) + 2 * 512 * 128 + 128 == 459392
    model = AutoModelForCausalLM.from_pretrained(tiny / "model")
    assert shape.params == sum(p.numel() for p in model.parameters())
    assert shape.kv_bytes_per_token(2) == 2 * 2 * 2 * 64 * 2


def workload(**kw) -> Workload:
    m = ModelShape(params=1e9, layers=10, hidden=1000, vocab=1000, kv_heads=1, head_dim=100)
    defaults = dict(actor=m, reference=m, critic=None, reward_models=(), samples=8, prompts=8, prompt_tokens=100,
                    response_tokens=100, dtype_bytes=4, forward_batch_size=8)
    return Workload(**{**defaults, **kw})


def test_trainer_memory_by_zero_stage():
    w = workload()
    # fp32, ZeRO-3 over 4 ranks: weights 4e9/4 + grads 4e9/4 + Adam 8e9/4; no activations at micro-batch 0
    assert trainer_memory(w.actor, w, 4, 3, 0) == pytest.approx(1e9 + 1e9 + 2e9)
    # bf16, ZeRO-1 over 2 ranks: weights 2e9 + grads 2e9 + (master 4 + Adam 8) x 1e9 / 2
    w16 = workload(dtype_bytes=2)
    assert trainer_memory(w16.actor, w16, 2, 1, 0) == pytest.approx(2e9 + 2e9 + 6e9)
    # activations: mb 2 x 200 tokens x 10 layers x 1000 hidden x 17 x 4 bytes; logits 2 x 200 x 1000 x 4 x 3
    assert trainer_memory(w.actor, w, 1, 0, 2) - trainer_memory(w.actor, w, 1, 0, 0) == \
        pytest.approx(2 * 200 * 10 * 1000 * 17 * 4 + 2 * 200 * 1000 * 4 * 3)


def test_micro_batches_by_token_budget_are_sized_and_counted_by_the_budget(tiny, tmp_path):
    """trainer.micro_batch_tokens 400 (two samples of 200 tokens): a micro-batch holds what 2 rows hold,
    whatever micro_batch_size is, and a rank's 8 samples take 4 micro-batches of 0.5 s; the search weighs
    no micro_batch_size (1 splits every update) and writes a config that keeps the budget."""
    from toolkit.placement.planner import write_config as write_plan

    budget = workload(micro_batch_tokens=400)
    assert trainer_memory(budget.actor, budget, 1, 0, 1) == trainer_memory(budget.actor, workload(), 1, 0, 2)
    assert trainer_memory(budget.actor, budget, 1, 0, 0) == trainer_memory(budget.actor, workload(), 1, 0, 0)
    s = Layout("flattening", (Group("all", ("generation", "reference", "reward", "actor")),), 2, 1, 1, "hf")
    by_rows = dataclasses.replace(s, micro_batch=8)
    assert estimate(s, budget, simple_cluster()).phases["train"] == pytest.approx(
        estimate(by_rows, workload(), simple_cluster()).phases["train"] + 3 * 0.5)
    cfg = load_config(write_config(tmp_path, example("tiny-grpo.yaml", tiny, trainer={"micro_batch_tokens": 560})))
    w = workload_of(cfg, 10.0)
    found = search(load_cluster(CLUSTERS / "2x8-h100.yaml"), w, cfg.trainer.zero_stage)
    assert found.fit and {p.setting.micro_batch for p in found.fit + found.rejected} == {1}
    write_plan(cfg, found.fit[0], tmp_path / "planned.yaml")
    assert load_config(tmp_path / "planned.yaml").trainer.micro_batch_tokens == 560


def test_ptx_text_rows_cost_the_actor_memory_and_time_by_hand(tiny, tmp_path):
    """ptx.coef > 0: each actor micro-batch of mb rows adds mb text rows of ptx.max_tokens (50), forward
    and backward in the same pass (update.py), so their activations and logits are held with the batch's;
    the critic has none."""
    ptx = workload(ptx_tokens=50)
    critic = dataclasses.replace(ptx.actor, value_head=True)
    assert trainer_memory(ptx.actor, ptx, 1, 0, 2) - trainer_memory(ptx.actor, workload(), 1, 0, 2) == \
        pytest.approx(2 * 50 * (10 * 1000 * 17 * 4 + 1000 * 4 * 3))
    assert trainer_memory(critic, ptx, 1, 0, 2) == trainer_memory(critic, workload(), 1, 0, 2)
    s = Layout("flattening", (Group("all", ("generation", "reference", "reward", "actor")),), 2, 8, 1, "hf")
    # one micro-batch of 8 rows: 6 FLOPs x 1e9 parameters x 8 x 50 tokens at 1e12
    assert estimate(s, ptx, simple_cluster()).phases["train"] - estimate(s, workload(), simple_cluster()).phases[
        "train"] == pytest.approx(6 * 1e9 * 8 * 50 / 1e12)
    (tmp_path / "ptx.jsonl").write_text('{"text": "one two three"}\n')
    cfg = load_config(write_config(tmp_path, example("tiny-grpo.yaml", tiny, ptx={
        "coef": 1.0, "max_tokens": 50, "data": {"sources": [{"path": str(tmp_path / "ptx.jsonl")}]}})))
    assert workload_of(cfg, 10.0).ptx_tokens == 50


def test_grpo_with_one_update_a_step_runs_no_forward_for_its_old_log_probs(tiny, tmp_path):
    """GRPO with one update a step and one epoch takes the old log-probs from the training forward
    (update.py `old_at_update`): the train phase has no 2*1e9*8*200/1e12 = 3.2 s pass and its 0.1 s call;
    two updates a step, or PPO, have it."""
    s = Layout("flattening", (Group("all", ("generation", "reference", "reward", "actor")),), 2, 8, 1, "hf")
    train = estimate(s, workload(), simple_cluster()).phases["train"]
    assert estimate(s, workload(old_logprobs_forward=False), simple_cluster()).phases["train"] == \
        pytest.approx(train - 3.3)
    grpo = load_config(write_config(tmp_path, example("tiny-grpo.yaml", tiny)))
    assert not workload_of(grpo, 10.0).old_logprobs_forward
    twice = load_config(write_config(tmp_path, example("tiny-grpo.yaml", tiny, trainer={"updates_per_step": 2})))
    ppo = load_config(write_config(tmp_path, example("tiny-ppo.yaml", tiny)))
    assert workload_of(twice, 10.0).old_logprobs_forward and workload_of(ppo, 10.0).old_logprobs_forward


def test_a_backend_the_run_names_is_the_one_planned_and_written(tiny, tmp_path):
    """rollout.backend hf (or vllm) fixes the engine: every plan generates with it, at TP 1 for hf, and
    `--write` keeps it; auto weighs both where the actor's group generates."""
    from toolkit.placement.planner import write_config as write_plan

    gpus = load_cluster(CLUSTERS / "2x8-h100.yaml")
    for backend in ("hf", "vllm"):
        cfg = load_config(write_config(tmp_path, example("tiny-grpo.yaml", tiny, rollout={"backend": backend})))
        found = search(gpus, workload_of(cfg, 10.0), cfg.trainer.zero_stage)
        assert found.fit and {p.setting.generation_engine for p in found.fit + found.rejected} == {backend}
        write_plan(cfg, found.fit[0], tmp_path / "planned.yaml")
        assert load_config(tmp_path / "planned.yaml").rollout.backend == backend
        if backend == "hf":
            assert {p.setting.tensor_parallel for p in found.fit + found.rejected} == {1}
    auto = load_config(write_config(tmp_path, example("tiny-grpo.yaml", tiny)))
    found = search(gpus, workload_of(auto, 10.0), 2, strategies=("flattening",), keep=10_000)
    engines = {p.setting.generation_engine for p in found.fit + found.rejected}
    assert engines == {"hf", "vllm"}


def test_a_strategy_without_a_plan_for_this_step_says_why_not_that_nodes_are_missing():
    """On one node of 8 GPUs, Flattening has 8 trainer ranks: 30 samples do not split over them, and 3
    prompts leave 5 of its 8 generators without one. It was reported "not possible on 1 node(s)"."""
    from toolkit.placement.planner import report

    c = load_cluster(CLUSTERS / "1x8-a100-80g.yaml")
    for samples, prompts, why in ((30, 15, "the step's 30 samples do not split evenly over its trainer's 8 rank(s) "
                                            "x trainer.updates_per_step 1"),
                                  (6, 3, "its generator would have 8 worker(s) or more, more than the step's 3 "
                                         "prompt(s)")):
        w = workload(samples=samples, prompts=prompts)
        found = search(c, w, 2, strategies=("flattening",))
        text = report(c, w, found)
        assert not found.fit and f"not possible with this step: flattening ({why}" in text, text
        assert "not possible on 1 node(s)" not in text


def simple_cluster(**kw) -> Cluster:
    data = {"name": "hand", "nodes": 1, "gpus_per_node": 0, "shared": True,
            "device": {"memory_gb": 1000, "flops": 1e12, "memory_bandwidth": 1e11},
            "links": {"intra_node": 1e10, "inter_node": 1e9, "latency_s": 0},
            "overheads": {"decode_step_vllm": 0.01, "decode_step_hf": 0.02, "forward_call": 0.1,
                          "train_micro_batch": 0.5, "optimizer_step": 1.0, "message": 0.0, "step": 0.0}}
    data.update(kw)
    return Cluster.model_validate(data)


def test_step_time_of_flattening_by_hand():
    w, c = workload(), simple_cluster()
    s = Layout("flattening", (Group("all", ("generation", "reference", "reward", "actor")),), 2, 8, 1, "hf")
    e = estimate(s, w, c)
    # generate: prefill 2*1e9*8*100/1e12 = 1.6; per token max(2*1e9*8/1e12 = 0.016, (4e9 + kv)/1e11 = 0.04+)
    kv = 8 * 150 * (2 * 10 * 1 * 100 * 4)
    assert e.phases["generate"] == pytest.approx(1.6 + 100 * ((4e9 + kv) / 1e11 + 0.02))  # transformers engine
    # score: reference forward 2*1e9*8*200/1e12 = 3.2 + one call 0.1 (no reward models)
    assert e.phases["score"] == pytest.approx(3.3)
    # train: old log-probs 3.3; forward+backward 6*1e9*8*200/1e12 = 9.6 + 1 micro-batch 0.5;
    # optimizer 1.0 + 16e9 bytes / 1e11 = 0.16
    assert e.phases["train"] == pytest.approx(3.3 + 9.6 + 0.5 + 1.0 + 0.16)
    assert e.phases["sync"] == 0.0 and e.phases["transport"] == 0.0  # shared tensors, no hop
    assert e.fits and e.memory["all"] > 16e9


def test_offload_gives_each_phase_of_a_shared_gpu_the_device_by_hand():
    """placement.offload on one GPU (Flattening, ZeRO-2, fp32): training holds the trainer's 16 GB of state
    and 1.1 GB of activations and logits; scoring, the reference (4 GB and 12.8 MB of logits) beside the
    trainer's weights and gradients (its 8 GB of Adam states parked in host memory while it does not
    train; fp32 has no master weights); generation, its 16 MB beside those. So the peak is training's, 4 GB
    under all of it at once, and each step moves the reference there and back (2 x 4 GB) and the parked
    states out and in (2 x 8 GB) over PCIe (2.5e10 B/s). On a CPU the same setting changes nothing."""
    w = workload()
    groups = (Group("all", ("generation", "reference", "reward", "actor")),)
    gpu = simple_cluster(gpus_per_node=1, shared=False)
    kept, moved = (estimate(Layout("flattening", groups, 2, 8, 1, "hf", offload), w, gpu) for offload in (False, True))
    trainer = 16e9 + 10 * 8 * 200 * 1000 * 17 * 4 + 8 * 200 * 1000 * 4 * 3
    reference = 4e9 + 8 * 200 * 1000 * 4 * 2
    assert kept.memory["all"] == pytest.approx(trainer + reference + 8 * (200 * 8000 + 1000 * 4 * 2 + 100 * 4))
    assert moved.memory["all"] == pytest.approx(trainer)
    assert moved.phases["generate"] == kept.phases["generate"]
    assert moved.phases["score"] - kept.phases["score"] == pytest.approx(2 * 4e9 / 2.5e10)
    assert moved.phases["train"] - kept.phases["train"] == pytest.approx(2 * 8e9 / 2.5e10)
    # bf16: 12 bytes a weight parked, Adam's states and the fp32 master weights (what the H200 measured)
    bf16 = workload(dtype_bytes=2)
    half = [estimate(Layout("flattening", groups, 2, 8, 1, "hf", o), bf16, gpu) for o in (False, True)]
    assert half[1].phases["train"] - half[0].phases["train"] == pytest.approx(2 * 12e9 / 2.5e10)
    cpu = [estimate(Layout("flattening", groups, 2, 8, 1, "hf", offload), w, simple_cluster()) for offload in (False, True)]
    assert cpu[0].memory == cpu[1].memory and cpu[0].phases == cpu[1].phases


def test_a_one_rank_trainer_moves_its_scorers_to_the_gpu_for_each_message_by_hand():
    """The reference and reward models beside the actor on one trainer rank score each generator worker's
    message as it arrives (the roles are not `deferred`: that takes several ranks), so with placement.offload
    the 4 GB reference goes to the GPU and back once per message: 2 x 4e9 B over PCIe (2.5e10 B/s) for
    each generator worker. (The planner charged one move a step there, as for several ranks.)"""
    w, gpu = workload(), simple_cluster(nodes=2, gpus_per_node=2, shared=False)
    extra = {}
    for generators in (1, 2):
        groups = (Group("generator", ("generation",), 1, generators, 1),
                  Group("trainer", ("actor", "reference", "reward"), 1, 1, 1))
        kept, moved = (estimate(Layout("separation", groups, 2, 8, 1, "vllm", offload), w, gpu)
                       for offload in (False, True))
        extra[generators] = moved.phases["score"] - kept.phases["score"]
    assert extra == {1: pytest.approx(2 * 4e9 / 2.5e10), 2: pytest.approx(2 * 2 * 4e9 / 2.5e10)}


def test_the_planner_turns_offload_on_where_nothing_fits_without_it_and_writes_it(tiny, tmp_path):
    """On one 20 GB GPU the case above needs 21.1 GB at once: every plan that fits offloads (with vLLM in
    the trainer's process too: its KV cache gets the device the parked state and the reference leave), the
    closest without it is told why not, and the plan written says placement.offload: true. Where the
    generator is a group of its own and everything fits without it, offloading only costs time."""
    from toolkit.placement.planner import report, write_config as write_plan

    c = simple_cluster(gpus_per_node=1, shared=False, device={"memory_gb": 20, "flops": 1e12, "memory_bandwidth": 1e11})
    found = search(c, workload(), 2, strategies=("flattening",))
    assert found.fit and all(p.setting.offload for p in found.fit)
    assert {p.setting.generation_engine for p in found.fit} == {"hf", "vllm"}
    assert any(not p.setting.offload for p in found.rejected)
    assert "offload" in report(c, workload(), found).splitlines()[3]  # (the table's header)
    cfg = load_config(write_config(tmp_path, example("tiny-grpo.yaml", tiny)))
    write_plan(cfg, found.fit[0], tmp_path / "planned.yaml")
    written = load_config(tmp_path / "planned.yaml")
    assert written.placement.offload and setting_of(written).offload
    roomy = search(simple_cluster(gpus_per_node=1, shared=False, nodes=3), workload(), 2, strategies=("separation",))
    step = {p.setting: p.estimate.step_s for p in roomy.fit}
    assert not roomy.fit[0].setting.offload and any(s.offload for s in step)  # (a small search shows every plan)
    assert all(step[s] > step[dataclasses.replace(s, offload=False)] for s in step if s.offload)


def test_separation_pays_for_sync_and_hops():
    w, c = workload(), simple_cluster()
    s = Layout("separation", (Group("generator", ("generation",)), Group("scorer", ("reference", "reward")),
                              Group("trainer", ("actor",))), 2, 8)
    e = estimate(s, w, c)
    # broadcast 4e9 bytes over 1e10 B/s + reload 4e9 / 1e11; two hops of 8*200*12 bytes
    assert e.phases["sync"] == pytest.approx(0.4 + 0.04)
    assert e.phases["transport"] == pytest.approx(2 * 8 * 200 * 12 / 1e10)
    flattening = Layout("flattening", (Group("all", ("generation", "reference", "reward", "actor")),), 2, 8, 1, "hf")
    assert e.phases["generate"] < estimate(flattening, w, c).phases["generate"]  # vLLM's decode step is cheaper here


def test_a_model_too_big_for_any_placement(tiny, tmp_path):
    config = write_config(tmp_path, example("tiny-ppo.yaml", tiny))
    result = cli("plan", config, "--cluster", CLUSTERS / "1x8-a100-80g.yaml", "--params", "actor=2e12",
                 "--params", "critic=2e12", "--params", "reference=2e12", timeout=120)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "no placement fits this cluster." in result.stdout
    assert "flattening (all[" in result.stdout and "GB short" in result.stdout
    assert ("not possible on 1 node(s) (a node group owns whole nodes, except a generator on the trainer's): "
            "separation (3 groups)") in result.stdout
    # two groups fit on one node when the generator takes some of the trainer's GPUs (it is weighed, and does
    # not fit either)
    assert "colocate_all_models (generator[generation] 1n of trainer x" in result.stdout


def test_a_larger_cluster_never_gets_a_slower_plan(tiny, tmp_path):
    cfg = load_config(write_config(tmp_path, example("tiny-ppo.yaml", tiny)))
    w = workload_of(cfg, prompt_tokens=200, response_tokens=300,
                    params={"actor": 7e9, "reference": 7e9, "critic": 7e9})
    base = load_cluster(CLUSTERS / "2x8-h100.yaml")
    best = []
    for nodes in (1, 2, 3, 4):
        fit = search(base.model_copy(update={"nodes": nodes}), w, cfg.trainer.zero_stage).fit
        best.append(fit[0].estimate.step_s if fit else float("inf"))
    assert best[0] >= best[1] >= best[2] >= best[3]
    assert best[3] < best[0]  # and more nodes did help


def eight_heads(tiny, tmp_path) -> str:
    """The tiny actor's files with 8 attention heads in its config.json: the stand-in of a model given by
    --params, whose plans may split generation over up to 8 GPUs (vLLM needs a TP size that divides the
    heads of the model a written config names; the tiny model has 2)."""
    import shutil

    model = tmp_path / "eight-heads"
    shutil.copytree(tiny / "model", model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "num_attention_heads": 8}))
    return str(model)


def test_plan_writes_a_config_that_loads(tiny, tmp_path):
    config = write_config(tmp_path, example("tiny-grpo.yaml", tiny))
    out = tmp_path / "planned.yaml"
    result = cli("plan", config, "--cluster", CLUSTERS / "2x8-h100.yaml", "--write", out, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    best = result.stdout.splitlines()[4].split()  # the first row of the table
    cfg = load_config(out)
    assert cfg.placement.strategy == best[1]
    assert str(cfg.trainer.zero_stage) in best and str(cfg.trainer.micro_batch_size) in best
    assert yaml.safe_load(out.read_text())["placement"]["strategy"] == best[1]
    # the setting read back from the written config is the one the planner chose
    assert setting_of(cfg).strategy == best[1]
    # Each GPU worker gets its share of its node's 112 cores (the template's cpus_per_node): without it,
    # Slurm gave each task one CPU, which a trainer's CPU Adam and vLLM's scheduler then shared.
    placed = plan(cfg)
    groups = [g for g in placed if g.gpus_per_worker]
    on_node = {g.name: sum(o.tasks_per_node for o in placed if (g.same_nodes_as or g.name) in (o.name, o.same_nodes_as))
               for g in groups}
    assert groups and all(g.cpus_per_worker == 112 // on_node[g.name] for g in groups), \
        [(g.name, g.cpus_per_worker, on_node[g.name]) for g in groups]
    data = example("tiny-grpo.yaml", tiny)  # (a group that sets its own keeps it)
    data["placement"] = {"strategy": "flattening", "all": {"cpus_per_worker": 3}}
    cli("plan", write_config(tmp_path, data, name="own.yaml"), "--cluster", CLUSTERS / "2x8-h100.yaml",
        "--strategy", "flattening", "--write", tmp_path / "own-planned.yaml", timeout=120)
    assert load_config(tmp_path / "own-planned.yaml").placement.group_with("actor").cpus_per_worker == 3
    # (a --write that cannot be written is refused before the search, not in a traceback after it)
    for bad, says in [(tmp_path, f"--write {tmp_path} is a directory"),
                      (tmp_path / "nodir" / "x.yaml", f"its folder {tmp_path / 'nodir'} does not exist"),
                      (config, f"--write {config} exists; choose another name, or --force to replace it")]:
        result = cli("plan", config, "--cluster", CLUSTERS / "2x8-h100.yaml", "--write", bad, timeout=120)
        assert result.returncode == 2 and says in result.stderr and "Traceback" not in result.stderr, result.stderr
    before = config.read_text()  # (the config planned: replaced only when asked, whole)
    assert cli("plan", config, "--cluster", CLUSTERS / "2x8-h100.yaml", "--write", config, "--force",
               timeout=120).returncode == 0
    assert config.read_text() != before and load_config(config).placement.strategy == best[1]


def test_trainer_memory_switches_by_hand():
    w = workload()  # fp32; the MLP is 4 x hidden = 4000 wide
    # ZeRO-Offload: no Adam states on the device (ZeRO-2 over 4 ranks: weights 4e9 + grads 4e9 / 4)
    assert trainer_memory(w.actor, w, 4, 2, 0, Switches(offload_optimizer=True)) == pytest.approx(4e9 + 1e9)
    # ZeRO-3 with the parameters offloaded too: only the gradient shard is left
    assert trainer_memory(w.actor, w, 4, 3, 0, Switches(offload_optimizer=True, offload_params=True)) == \
        pytest.approx(1e9)
    # checkpointing: each layer's input (2 x 200 tokens x 1000 x 4 bytes x 10 layers) + one layer's 17x
    plain = trainer_memory(w.actor, w, 1, 0, 2)
    checkpointed = trainer_memory(w.actor, w, 1, 0, 2, Switches(checkpointing=True))
    assert plain - checkpointed == pytest.approx(2 * 200 * 1000 * 4 * (17 * 10 - 10 - 17))
    # LoRA rank 8 on the 7 projections: 8 x 10 layers x (q, o: 2 x 2000; k, v: 2 x 1100; MLP: 3 x 5000)
    adapters = 8 * 10 * (2 * 2000 + 2 * 1100 + 3 * 5000)
    assert w.actor.lora_params(8) == adapters
    assert trainer_memory(w.actor, w, 1, 0, 0, Switches(lora_rank=8)) == pytest.approx(4e9 + adapters * (4 + 8))


def test_switches_cost_time_by_hand():
    """Checkpointing runs the forward pass again, LoRA computes no weight gradients, and on GPU nodes the
    offloaded optimizer steps on the host and its bytes cross PCIe (on CPU nodes the host is the device)."""
    layout = Layout("flattening", (Group("all", ("generation", "reference", "reward", "actor")),), 2, 8, 1, "hf")
    train = {}
    for name, sw in (("plain", Switches()), ("checkpointing", Switches(checkpointing=True)),
                     ("lora", Switches(lora_rank=8)), ("offload", Switches(offload_optimizer=True))):
        w = workload(switches=sw)
        train[name] = estimate(layout, w, simple_cluster()).phases["train"]
        train["gpu " + name] = estimate(layout, w, simple_cluster(gpus_per_node=1, shared=False)).phases["train"]
    pass_s = 2 * 1e9 * 8 * 200 / 1e12  # 2 FLOPs per parameter and token, 8 samples x 200 tokens at 1e12
    assert train["checkpointing"] - train["plain"] == pytest.approx(pass_s)
    # (LoRA also reads fewer optimizer states: 1e9 x 4 weights + 8 x 10 x 21200 adapters x 12, not 16e9 bytes)
    adapters = 8 * 10 * (2 * 2000 + 2 * 1100 + 3 * 5000)
    assert train["plain"] - train["lora"] == pytest.approx(pass_s + (16e9 - 4e9 - adapters * 12) / 1e11)
    assert train["offload"] == pytest.approx(train["plain"] - 8e9 / 1e11)  # (a CPU node: Adam's states leave)
    # a GPU node: one update of 1e9 parameters through the host's Adam (default 7e7/s), the gradients down
    # and the weights up over the default 2.5e10 B/s host link
    host = 1e9 / 7e7 + 2 * 4e9 / 2.5e10
    assert train["gpu offload"] == pytest.approx(train["gpu plain"] - 8e9 / 1e11 + host)
    zero3 = Layout("flattening", (Group("all", ("generation", "reference", "reward", "actor")),), 3, 8, 1, "hf")
    w = workload(switches=Switches(offload_optimizer=True, offload_params=True))
    gpu = simple_cluster(gpus_per_node=1, shared=False)
    plain3 = estimate(zero3, workload(switches=Switches(offload_optimizer=True)), gpu).phases["train"]
    # ZeRO-3 parameter offload: each of the 1 micro-batch's forward and backward fetches 4e9 bytes; the
    # optimizer step then reads no weights on the device either
    assert estimate(zero3, w, gpu).phases["train"] == pytest.approx(plain3 + 2 * 4e9 / 2.5e10 - 4e9 / 1e11)


def test_lora_is_the_actors_alone_and_only_its_adapters_cross_the_links():
    """LoRA trains the actor's adapters; the critic trains whole (`trainer.lora` is the actor's, as
    DeepSpeed-Chat's `--actor_lora_dim`). Under ZeRO-2 over 2 GPUs of a node, an update reduces the
    gradients and gathers the weights of what trains: the actor's adapters, and the whole critic."""
    m = ModelShape(params=1e9, layers=10, hidden=1000, vocab=1000, kv_heads=1, head_dim=100)
    critic = ModelShape(params=1e9, layers=10, hidden=1000, vocab=1000, kv_heads=1, head_dim=100, value_head=True)
    layout = Layout("flattening", (Group("all", ("generation", "reference", "reward", "actor", "critic"), 1, 2),),
                    2, 4, 1, "hf")
    # (compute and memory reads free, no per-call costs: what is left of training is the links' time)
    free = simple_cluster(gpus_per_node=2, shared=False, device={"memory_gb": 1000, "flops": 1e30,
                                                                 "memory_bandwidth": 1e30},
                          overheads={"decode_step_vllm": 0, "decode_step_hf": 0, "forward_call": 0,
                                     "train_micro_batch": 0, "optimizer_step": 0, "message": 0, "step": 0})
    adapters = m.lora_params(8)
    lora = workload(critic=critic, switches=Switches(lora_rank=8))
    # 2 x (trained parameters x 4 bytes) x ring (1/2) x 1 update, over the node's 1e10 B/s
    expected = (2 * adapters * 4 * 0.5 + 2 * 1e9 * 4 * 0.5) / 1e10
    assert estimate(layout, lora, free).phases["train"] == pytest.approx(expected)
    # memory: the actor's adapters with their gradients and Adam states; the critic's whole
    e = estimate(layout, lora, simple_cluster(gpus_per_node=2, shared=False))
    whole = estimate(layout, workload(critic=critic), simple_cluster(gpus_per_node=2, shared=False))
    assert whole.memory["all"] - e.memory["all"] == pytest.approx(
        trainer_memory(m, lora, 2, 2, 4, Switches()) - trainer_memory(m, lora, 2, 2, 4))


def test_with_lora_there_is_no_reference_to_place_hold_or_score_and_the_plans_written_load(tiny, tmp_path):
    """With trainer.lora the reference is the actor with its adapters disabled, run by the trainer
    (RunConfig.hosts): no preset group hosts it (colocate_critic_reward, whose group would host nothing, is
    not weighed), nothing holds its weights, and its forward is the trainer's, on each rank's shard."""
    from toolkit.placement.planner import write_config as write_plan

    lora = workload(switches=Switches(lora_rank=8), reference=None)
    c = simple_cluster()
    with_ref = Layout("flattening", (Group("all", ("generation", "reference", "reward", "actor")),), 2, 8, 1, "hf")
    alone = Layout("flattening", (Group("all", ("generation", "reward", "actor")),), 2, 8, 1, "hf")
    e = estimate(alone, lora, c)  # (a layout without a reference group: no StopIteration)
    assert e.phases["score"] == 0.0 and e.memory == estimate(with_ref, lora, c).memory
    # train: the old log-probs' and the reference's forwards, 2 x (2*1e9*8*200/1e12 + one call 0.1); forward
    # and backward without weight gradients 4*1e9*8*200/1e12 + 1 micro-batch 0.5; optimizer 1.0 + its bytes
    state = 4e9 + lora.actor.lora_params(8) * (4 + 8)
    assert e.phases["train"] == pytest.approx(2 * 3.3 + 6.4 + 0.5 + 1.0 + state / 1e11)
    gpus = load_cluster(CLUSTERS / "2x8-h100.yaml")
    cfg = load_config(write_config(tmp_path, example("tiny-grpo.yaml", tiny, trainer={"lora": {"rank": 8}})))
    assert workload_of(cfg, 10.0).reference is None
    found = search(gpus, workload_of(cfg, 10.0), cfg.trainer.zero_stage)
    assert found.unused == ("colocate_critic_reward",)
    plans = found.fit + found.rejected
    assert plans and not any("reference" in g.models for p in plans for g in p.setting.groups)
    for strategy in dict.fromkeys(p.setting.strategy for p in found.fit):  # each strategy's best plan loads
        out = tmp_path / f"{strategy}.yaml"
        write_plan(cfg, next(p for p in found.fit if p.setting.strategy == strategy), out)
        written = load_config(out)
        assert estimate(setting_of(written), workload_of(written, 10.0), gpus).step_s > 0


def test_critic_and_reward_models_hold_values_not_the_vocabularys_logits():
    m = ModelShape(params=1e9, layers=10, hidden=1000, vocab=1000, kv_heads=1, head_dim=100)
    w = workload(critic=m, reward_models=(m,))
    assert w.critic.outputs == w.reward_models[0].outputs == 1 and w.actor.outputs == 1000
    # logits of a micro-batch of 2 x 200 tokens, x 4 bytes x 3 copies: the actor's per word, the critic's one
    assert trainer_memory(w.actor, w, 1, 0, 2) - trainer_memory(w.critic, w, 1, 0, 2) == \
        pytest.approx(2 * 200 * (1000 - 1) * 4 * 3)


def test_lora_count_equals_peft_on_the_tiny_model(tiny):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny / "model"),
                           LoraConfig(r=8, target_modules="all-linear"))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert ModelShape.from_config(tiny / "model").lora_params(8) == trainable


def test_a_trainer_that_does_not_fit_is_told_which_switch_would_fit():
    w = workload()
    plain = trainer_memory(w.actor, w, 1, 2, 8)
    with_checkpointing = trainer_memory(w.actor, w, 1, 2, 8, Switches(checkpointing=True))
    both = trainer_memory(w.actor, w, 1, 2, 8, Switches(checkpointing=True, offload_optimizer=True))
    assert both < with_checkpointing < plain
    hint = remedy([(w.actor, True)], w, 1, 2, 8, 0.0, with_checkpointing + 1)
    assert hint == f"; fits with trainer.gradient_checkpointing: true ({with_checkpointing / 1e9:.1f} GB)"
    hint = remedy([(w.actor, True)], w, 1, 2, 8, 0.0, both + 1)
    assert "trainer.gradient_checkpointing: true, trainer.offload_optimizer: true" in hint
    on = workload(switches=Switches(checkpointing=True))  # a switch already on is not suggested again
    assert remedy([(on.actor, True)], on, 1, 2, 8, 0.0, both + 1) == f"; fits with trainer.offload_optimizer: true ({both / 1e9:.1f} GB)"
    assert "no trainer memory switch is enough" in remedy([(w.actor, True)], w, 1, 2, 8, 0.0, 1e9)


def test_deepspeed_chats_opt13b_ppo_fits_one_a100_node_with_the_switches_it_names(tiny, tmp_path):
    """DeepSpeed-Chat's OPT-13B PPO with an OPT-350M reward model on one node of 8 A100-80G, every model
    on all 8 GPUs as DeepSpeed-Chat runs it (flattening): it fits without a switch only under ZeRO-3, with
    the reference and reward model sharded over the 8 ranks as DeepSpeed-Chat shards them; under ZeRO-2
    (a whole reference on every GPU) the planner names the switch DeepSpeed-Chat's script turns on
    (gradient checkpointing; the critic and reward model hold values, not the vocabulary's logits), and
    with it ZeRO-2 plans fit too; so do ZeRO-2 plans with `placement.offload` (the reference in host memory
    but while it scores, as DeepSpeed-Chat's `--offload_reference_model`, and the trainer's optimizer
    state there while it generates). Split as OpenRLHF splits a node (vLLM on some GPUs, the training models
    under ZeRO-3 with the reference sharded beside them on the others), it fits without a switch, and its
    best plan is written as a config that submits."""
    config = write_config(tmp_path, example("tiny-ppo.yaml", tiny,
                                            model={"dtype": "bfloat16", "actor": eight_heads(tiny, tmp_path)}))
    args = ["plan", config, "--cluster", CLUSTERS / "1x8-a100-80g.yaml", "--params", "actor=13e9", "--params",
            "reference=13e9", "--params", "critic=350e6", "--params", "reward=350e6", "--prompt-tokens", "256",
            "--response-tokens", "256"]
    result = cli(*args, "--strategy", "flattening", timeout=120)
    assert result.returncode == 0, result.stdout
    assert "(all[generation,reference,reward,actor,critic] 1n x8, ZeRO-2, mb 1): all (generation, reference, reward, " \
           "actor, critic) needs" in result.stdout and "fits with trainer.gradient_checkpointing: true (" in result.stdout
    plans = json.loads(cli(*args, "--strategy", "flattening", "--json", timeout=120).stdout)["plans"]
    assert {p["zero_stage"] for p in plans if p["fits"] and not p["offload"]} == {3}
    assert all(not p["fits"] for p in plans if p["zero_stage"] < 3 and not p["offload"])
    assert {p["zero_stage"] for p in plans if p["fits"] and p["offload"]} >= {2}
    pinned = json.loads(cli(*args, "--strategy", "flattening", "--json", "--offload", "off", timeout=120).stdout)["plans"]
    assert pinned and not any(p["offload"] for p in pinned)  # (--offload off: as before the planner weighed it)
    assert [p["step_s"] for p in pinned if p["fits"]] == [p["step_s"] for p in plans if p["fits"] and not p["offload"]]
    plans = json.loads(cli(*args, "--strategy", "flattening", "--json", "--set", "trainer.gradient_checkpointing=true",
                           timeout=120).stdout)["plans"]
    assert {p["zero_stage"] for p in plans if p["fits"]} >= {2, 3}
    split = [*args, "--strategy", "colocate_all_models"]
    best = json.loads(cli(*split, "--json", "--top", "1", timeout=120).stdout)["plans"][0]
    generator, trainer = best["groups"]
    assert best["fits"] and best["strategy"] == "colocate_all_models" and best["zero_stage"] == 3
    assert generator["same_nodes_as"] == "trainer" and generator["nodes"] == trainer["nodes"] == 1
    assert generator["workers"] * generator["gpus_per_worker"] + trainer["workers"] * trainer["gpus_per_worker"] == 8
    # --write gives a config that loads and asks Slurm for one node with both groups' GPUs
    out = tmp_path / "planned.yaml"
    assert cli(*split, "--write", out, timeout=120).returncode == 0
    cfg = load_config(out)
    assert cfg.placement.group_with("generation").same_nodes_as == "trainer"
    dry = cli("submit", out, "--dry-run", "--run-dir", tmp_path / "run", timeout=120)
    assert dry.returncode == 0, dry.stdout + dry.stderr
    assert "#SBATCH --nodes=1\n" in dry.stdout and "1 (trainer's)" in dry.stdout
    tasks = int(dry.stdout.split("#SBATCH --ntasks-per-node=")[1].split()[0])
    gpus = dry.stdout.split("#SBATCH --gpus-per-")[1].split()[0]  # task=G or node=G
    assert tasks * int(gpus.split("=")[1]) == 8 if gpus.startswith("task") else gpus == "node=8", dry.stdout


def test_plan_json_lists_every_plan_with_its_phases_memory_and_why_not(tiny, tmp_path):
    config = write_config(tmp_path, example("tiny-ppo.yaml", tiny))
    result = cli("plan", config, "--cluster", CLUSTERS / "2x8-h100.yaml", "--json", timeout=120)
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)  # (nothing else on stdout)
    plans = out["plans"]
    assert len(plans) == min(out["fitting"], 200) > 10 and out["not_fitting"] == 0  # all kept, not the table's 10
    assert [p["rank"] for p in plans] == list(range(1, len(plans) + 1))
    assert [p["step_s"] for p in plans] == sorted(p["step_s"] for p in plans)
    for p in plans:
        assert p["fits"] and not p["why_not"]
        assert p["step_s"] == pytest.approx(sum(p["phases_s"].values()))
        assert set(p["phases_s"]) == {"generate", "score", "train", "sync", "transport"}
        assert set(p["memory_gb_per_device"]) == {g["name"] for g in p["groups"]}
        assert {"critic", "actor"} <= {m for g in p["groups"] for m in g["models"]}  # (PPO)
    table = cli("plan", config, "--cluster", CLUSTERS / "2x8-h100.yaml", timeout=120).stdout
    best = table.splitlines()[4].split()
    assert best[1] == plans[0]["strategy"] and f"{plans[0]['step_s']:.3f}" in best
    # none fits: each plan says why, exit 1
    result = cli("plan", config, "--cluster", CLUSTERS / "1x8-a100-80g.yaml", "--params", "actor=2e12", "--json",
                 "--top", "3", timeout=120)
    assert result.returncode == 1
    out = json.loads(result.stdout)
    assert out["fitting"] == 0 and out["not_fitting"] > 3 and len(out["plans"]) == 3
    assert all(not p["fits"] and p["rank"] is None and any("GB short" in w for w in p["why_not"]) for p in out["plans"])


def test_node_counts_are_every_count_up_to_16_then_powers_of_two_and_half_again():
    assert node_counts(5) == [1, 2, 3, 4, 5]
    assert node_counts(100) == [*range(1, 17), 24, 32, 48, 64, 96, 100]


def llama_ppo(config: str) -> Workload:
    shape = ModelShape.from_config(REPO / "tests" / "fixtures" / "model_configs" / config)
    return Workload(actor=shape, reference=shape, critic=shape, reward_models=(shape,), samples=1024, prompts=1024,
                    prompt_tokens=1024, response_tokens=1024, dtype_bytes=2, switches=Switches(checkpointing=True))


def test_the_planner_gives_vllm_only_tp_sizes_that_divide_the_policys_attention_heads():
    """vLLM splits the attention heads over its tensor-parallel ranks and does not start where they do not
    divide: Qwen2.5-7B's 28 heads take TP 1, 2 or 4 on nodes of 8 GPUs (the planner offered 8 too before),
    Llama-2-7B's 32 heads TP 8 too."""
    cluster = load_cluster(CLUSTERS / "2x8-h100.yaml")
    sizes = {}
    for config in ("Qwen--Qwen2.5-7B-Instruct.json", "meta-llama--Llama-2-7b-hf.json"):
        found = search(cluster, llama_ppo(config), 3, strategies=("colocate_all_models",), keep=10**6)
        sizes[config] = {c.setting.tensor_parallel for c in found.fit + found.rejected}
    assert sizes == {"Qwen--Qwen2.5-7B-Instruct.json": {1, 2, 4}, "meta-llama--Llama-2-7b-hf.json": {1, 2, 4, 8}}
    assert ModelShape.from_config(REPO / "tests" / "fixtures" / "model_configs" / "facebook--opt-13b.json").heads == 40
    assert ModelShape.from_params(13e9).heads is None  # (a guessed shape: its heads are not known)
    # and its key/value heads: 40 heads and 10 KV heads (Phi-3 medium's) split over 2 ranks, not 4 or 8
    w = llama_ppo("meta-llama--Llama-2-13b-hf.json")
    grouped = dataclasses.replace(w.actor, kv_heads=10)
    found = search(cluster, dataclasses.replace(w, actor=grouped, reference=grouped), 3,
                   strategies=("colocate_all_models",), keep=10**6)
    assert {c.setting.tensor_parallel for c in found.fit + found.rejected} == {1, 2}


def test_with_the_parameters_offloaded_the_planner_plans_zero_3_alone():
    """trainer.offload_params needs ZeRO-3; the planner ranked ZeRO-1 and 2 plans too, and `--write` then
    wrote a config that its own validation refused."""
    w = llama_ppo("meta-llama--Llama-2-7b-hf.json")
    offloaded = dataclasses.replace(w, switches=Switches(checkpointing=True, offload_optimizer=True,
                                                         offload_params=True))
    found = search(load_cluster(CLUSTERS / "2x8-h100.yaml"), offloaded, 3, strategies=("colocate_all_models",))
    assert found.fit and {c.setting.zero_stage for c in found.fit + found.rejected} == {3}


def test_a_large_search_picks_the_trainers_settings_first_and_finds_the_same_best_plan():
    """Past `keep` layouts a strategy, each trainer size keeps only its fastest (ZeRO, micro-batch) that
    fits: far fewer plans are estimated, and the best plan is the one that trying every setting finds."""
    cluster = load_cluster(CLUSTERS / "2x8-h100.yaml").model_copy(update={"nodes": 6})
    w = llama_ppo("meta-llama--Llama-2-7b-hf.json")
    every = search(cluster, w, 3, keep=10**6)
    pruned = search(cluster, w, 3, keep=20)
    assert pruned.estimated < every.estimated / 3
    assert len(pruned.fit) == 20 and pruned.fitting < every.fitting
    assert pruned.fit[0].setting == every.fit[0].setting
    assert pruned.fit[0].estimate.step_s == every.fit[0].estimate.step_s
    steps = [c.estimate.step_s for c in pruned.fit]
    assert steps == sorted(steps)


def test_128_nodes_are_searched_without_keeping_every_plan():
    """128 nodes x 8 H100 (tools/bench_planner.py times it): a bounded number of estimates (the memory of
    every layout is known, its step time bounded below, and only those that can be among the kept are
    estimated), the fastest kept plans in order; the 70B PPO fits only with the reference and reward
    models sharded over the trainer's ranks (ZeRO-3), and separation is told why not (each scorer worker
    holds a whole model, offloading or not)."""
    cluster = load_cluster(CLUSTERS / "2x8-h100.yaml").model_copy(update={"nodes": 128})
    found = search(cluster, llama_ppo("meta-llama--Llama-2-7b-hf.json"), 3)
    assert found.estimated < 10_000 and found.fitting > 100_000 and len(found.fit) == 200
    assert sum(found.skipped.values()) > 100_000
    best = found.fit[0]
    # vLLM engines of their own; the reference and reward model, where they sit with the trainer, score on
    # its ranks
    assert not best.setting.generation_with_actor
    assert sum(g.nodes for g in best.setting.groups if g.same_nodes_as is None) <= 128
    assert best.setting.strategy in ("separation", "colocate_actor_ref", "colocate_all_models")
    steps = [c.estimate.step_s for c in found.fit]
    assert steps == sorted(steps)
    big = search(cluster, llama_ppo("meta-llama--Llama-2-70b-hf.json"), 3)
    assert big.fit and {(c.setting.strategy, c.setting.zero_stage) for c in big.fit} == {("colocate_all_models", 3)}
    trainer = next(g for g in big.fit[0].setting.groups if "actor" in g.models)
    assert trainer.workers >= 256 and big.fit[0].estimate.memory["trainer"] <= 80e9
    needs = [float(m.group(1)) for c in big.rejected if c.setting.strategy == "separation" for why in c.estimate.short
             if (m := re.search(r"scorer \(reference, reward\) needs ([\d.]+) GB", why))]
    assert needs and min(needs) > 140  # (a whole 70B model, 140 GB, even with the other in host memory)


@pytest.mark.parametrize("strategy", list(PRESETS))
def test_every_preset_means_the_same_to_config_planner_and_cost_model(strategy, tiny, tmp_path):
    """Whether generation shares the actor's workers is decided in placement/layout.py only: the config,
    the planner's layout of a config and the cost model (no weight sync there) agree for every preset."""
    cfg = load_config(write_config(tmp_path, example("tiny-ppo.yaml", tiny, placement={"strategy": strategy})))
    layout = setting_of(cfg)
    with_actor = strategy in ("flattening", "interleaving")
    assert cfg.placement.generation_with_actor() == layout.generation_with_actor == with_actor
    assert layout.group("generation").own_engine != with_actor
    assert [g.name for g in layout.groups] == list(PRESETS[strategy])
    sync = estimate(layout, workload(), simple_cluster()).phases["sync"]
    assert (sync == 0.0) == with_actor


def test_every_cluster_file_loads_and_plan_takes_a_node_count(tiny, tmp_path):
    names = {load_cluster(path).name for path in CLUSTERS.glob("*.yaml")}
    assert {"1 node of 8x A100-40GB", "1 node of 8x A800-80GB", "1 node of 8x H200-141GB"} <= names
    config = write_config(tmp_path, example("tiny-grpo.yaml", tiny))
    result = cli("plan", config, "--cluster", CLUSTERS / "1x8-h200.yaml", "--nodes", "3", "--json", timeout=120)
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["cluster"]["nodes"] == 3 and out["cluster"]["device_memory_gb"] == 141
    assert "separation" in {p["strategy"] for p in out["plans"]}  # (3 groups: possible on 3 nodes, not on 1)
    result = cli("plan", config, "--cluster", CLUSTERS / "1x8-h200.yaml", "--nodes", "0", timeout=120)
    assert result.returncode != 0 and "--nodes 0: at least 1" in result.stderr
    for args, message in ((["--top", "0"], "--top 0: at least 1"),
                          (["--prompt-tokens", "-10"], "--prompt-tokens -10: a mean token count, at least 1"),
                          (["--params", "actor=nan"], "'actor=nan': COUNT is a positive number of parameters")):
        result = cli("plan", config, "--cluster", CLUSTERS / "1x8-h200.yaml", *args, timeout=120)
        assert result.returncode == 2 and message in result.stderr and "Traceback" not in result.stderr, args


def test_a_vllm_generator_holds_what_its_kv_cache_budget_allows_and_generates_in_waves():
    """KV cache: 2 x 10 layers x 1 head x 100 x 4 bytes = 8,000 bytes a token, 1.6 MB a 200-token sequence:
    a budget of 0.005 GiB (rollout.vllm.kv_cache_gb is GiB, as the engine reads it: 5.37 MB) holds 3
    sequences, so 8 samples take 3 waves of 3."""
    separation = Layout("separation", (Group("generator", ("generation",)), Group("scorer", ("reference", "reward")),
                                       Group("trainer", ("actor",))), 2, 8)
    e = estimate(separation, workload(kv_cache_gb=0.005), simple_cluster())
    assert e.memory["generator"] == pytest.approx(4e9 + 0.005 * 2**30) and e.kv_cache_gb == pytest.approx(0.005)
    # a wave: prefill 2 x 1e9 x 3 x 100 / 1e12; 100 decode steps of max(2e9 x 3 / 1e12, (4e9 + KV of 3 x 150
    # tokens) / 1e11) + vLLM's 0.01
    wave = 2e9 * 3 * 100 / 1e12 + 100 * ((4e9 + 3 * 150 * 8000) / 1e11 + 0.01)
    assert e.phases["generate"] == pytest.approx(3 * wave)
    small = estimate(separation, workload(kv_cache_gb=0.001), simple_cluster())
    assert not small.fits and "holds no whole sequence of 200 tokens" in small.short[0]


def test_vllm_with_more_tp_ranks_than_key_value_heads_copies_them_on_each_rank():
    """vLLM gives each TP rank its share of the key/value heads, at least one: the model's one head at TP 2
    is on both ranks, 8,000 bytes a token on each (not 4,000), so a 5 MB budget a rank still holds 3
    sequences (not 6) and each rank reads its whole KV cache at each decode step."""
    separation = Layout("separation", (Group("generator", ("generation",), 1, 1, 2), Group("scorer", ("reference",
                        "reward")), Group("trainer", ("actor",))), 2, 8, 2)
    e = estimate(separation, workload(kv_cache_gb=0.005), simple_cluster())
    wave = 2e9 * 3 * 100 / (2 * 1e12) + 100 * ((4e9 / 2 + 3 * 150 * 8000) / 1e11 + 0.01)
    assert e.phases["generate"] == pytest.approx(3 * wave)
    assert workload().actor.vllm_kv_bytes_per_token(4, 2) == 8000
    assert dataclasses.replace(workload().actor, kv_heads=8).vllm_kv_bytes_per_token(4, 2) == 8 // 2 * 8000


def test_a_plan_for_gpus_sizes_the_kv_cache_and_writes_it(tiny, tmp_path):
    config = write_config(tmp_path, example("tiny-grpo.yaml", tiny))
    out = tmp_path / "planned.yaml"
    result = cli("plan", config, "--cluster", CLUSTERS / "1x8-h200.yaml", "--nodes", "3", "--strategy", "separation",
                 "--write", out, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    written = load_config(out)
    # (GiB: 90% of 141 GB, the tiny model's weights being nothing)
    assert 0.9 * 141e9 / 2**30 - 1 < written.rollout.vllm.kv_cache_gb <= 0.9 * 141e9 / 2**30
    # generation in the trainer's 8 workers: vLLM in each one's process (faster than transformers there),
    # with the KV cache its device has room for beside the trainer's state (asleep while it trains)
    result = cli("plan", config, "--cluster", CLUSTERS / "1x8-h200.yaml", "--strategy", "flattening", "--write", out,
                 "--force", timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    written = load_config(out)
    assert written.rollout.backend == "vllm" and written.placement.group_with("actor").workers == 8
    assert 0.9 * 141e9 / 2**30 - 2 < written.rollout.vllm.kv_cache_gb <= 0.9 * 141e9 / 2**30
    assert written.rollout.generate_batch_size is None


def test_transformers_generates_its_batch_at_once_in_waves():
    """rollout.generate_batch_size 3 of 8 samples: 3 waves of 3; memory for 3 samples' KV cache (1.6 MB
    each), one step's scores (1,000 vocabulary x 4 bytes, and their softmax) and the drawn tokens' log-probs
    (100 x 4 bytes): the sampler keeps no step's scores after it (SeededDraw)."""
    flattening = Layout("flattening", (Group("all", ("generation", "reference", "reward", "actor")),), 2, 8, 1, "hf")
    every = estimate(flattening, workload(), simple_cluster())
    three = estimate(flattening, workload(generate_batch=3), simple_cluster())
    assert every.generate_batch == 8 and three.generate_batch == 3
    assert every.memory["all"] - three.memory["all"] == pytest.approx(5 * (1.6e6 + 1000 * 4 * 2 + 100 * 4))
    wave = 2e9 * 3 * 100 / 1e12 + 100 * ((4e9 + 3 * 150 * 8000) / 1e11 + 0.02)
    assert three.phases["generate"] == pytest.approx(3 * wave)


def test_the_hybrid_engines_inference_tp_splits_the_gathered_actor_over_ranks():
    """DeepSpeed-Chat's Hybrid Engine with `--inference_tp_size 2` (published runs: our runtime gathers the
    whole actor on each rank, so the planner plans TP 1 there): under ZeRO-3 each of 4 ranks holds half
    of the gathered 4 GB actor, and each pair of ranks generates its 4 samples at once, reading half the
    weights per decode step; the samples are still scored where they were generated, 2 per rank."""
    c = simple_cluster(shared=False, gpus_per_node=4)
    group = (Group("all", ("generation", "reference", "reward", "actor"), 1, 4),)
    one, two = (estimate(Layout("flattening", group, 3, 2, tp, "hf"), workload(), c) for tp in (1, 2))
    assert (one.generate_batch, two.generate_batch) == (2, 4)
    # weights 4e9 / TP; per sample: KV 200 tokens x 8,000 bytes / TP, one step's scores 1,000 x 4 x 2 bytes
    # and 100 log-probs of 4 bytes
    assert one.memory["all"] - two.memory["all"] == pytest.approx(4e9 / 2 + 2 * (1.6e6 + 8400) - 4 * (0.8e6 + 8400))
    wave = {tp: 2e9 * batch * 100 / (tp * 1e12) + 100 * (max(2e9 * batch / (tp * 1e12),
                                                              (4e9 + batch * 150 * 8000) / (tp * 1e11)) + 0.02)
            for tp, batch in ((1, 2), (2, 4))}
    assert (one.phases["generate"], two.phases["generate"]) == (pytest.approx(wave[1]), pytest.approx(wave[2]))
    assert one.phases["score"] == two.phases["score"]
    found = search(c, workload(), 3, strategies=("flattening",))
    assert found.fit and {p.setting.tensor_parallel for p in found.fit + found.rejected} == {1}


def test_asynchronous_mode_takes_the_busiest_group_not_the_sum():
    """max_policy_lag 1 with generators of their own, on nodes of their own: generation (and its weight
    sync) overlaps scoring and training, so a step takes the busiest group plus transport."""
    separation = Layout("separation", (Group("generator", ("generation",)), Group("scorer", ("reference", "reward")),
                                       Group("trainer", ("actor",))), 2, 8)
    cluster = simple_cluster(shared=False, nodes=3)
    sync, lagged = (estimate(separation, workload(max_policy_lag=lag), cluster) for lag in (0, 1))
    p = sync.phases
    assert lagged.phases == p and sync.step_s == pytest.approx(sum(p.values()))
    assert lagged.step_s == pytest.approx(max(p["generate"] + p["sync"], p["score"], p["train"] + p["sync"])
                                          + p["transport"])
    assert lagged.step_s < sync.step_s
    flattening = Layout("flattening", (Group("all", ("generation", "reference", "reward", "actor")),), 2, 8, 1, "hf")
    shared = estimate(flattening, workload(max_policy_lag=1), cluster)  # (no generators of its own: no overlap)
    assert shared.step_s == pytest.approx(sum(shared.phases.values()))


def test_asynchronous_mode_on_one_shared_machine_fills_what_generation_leaves_idle():
    """On one machine the groups take turns on its cores, except for the share that generation leaves idle
    (device.generation_idle): the next step's scoring and training fill it, the rest comes on top."""
    separation = Layout("separation", (Group("generator", ("generation",)), Group("scorer", ("reference", "reward")),
                                       Group("trainer", ("actor",))), 2, 8)
    device = {"memory_gb": 1000, "flops": 1e12, "memory_bandwidth": 1e11}
    base = simple_cluster().overheads.model_dump()
    fits = []
    for decode_s in (0.01, 1.0):  # (generation shorter than scoring + training, then longer)
        steps = {}
        for idle in (0.0, 0.4, 0.9):
            cluster = simple_cluster(device={**device, "generation_idle": idle},
                                     overheads={**base, "decode_step_vllm": decode_s})
            sync, lagged = (estimate(separation, workload(max_policy_lag=lag), cluster) for lag in (0, 1))
            p = sync.phases
            assert lagged.phases == p and sync.step_s == pytest.approx(sum(p.values()))
            steps[idle] = lagged.step_s
            left = max(0.0, p["score"] + p["train"] - idle * p["generate"])  # (what does not fit in the idle share)
            assert lagged.step_s == pytest.approx(p["generate"] + left + p["sync"] + p["transport"])
        rest = p["score"] + p["train"]
        assert steps[0.0] == pytest.approx(sum(p.values()))  # nothing idle: no gain
        fits.append(rest < 0.4 * p["generate"])
        if rest > 0.9 * p["generate"]:  # what generation leaves idle holds part of the rest
            assert steps[0.4] == pytest.approx(steps[0.0] - 0.4 * p["generate"])
            assert steps[0.9] == pytest.approx(steps[0.0] - 0.9 * p["generate"])
        else:  # all of it, from 0.4 (or 0.9) of generation on
            assert rest < 0.4 * p["generate"]
            assert steps[0.4] == steps[0.9] == pytest.approx(p["generate"] + p["sync"] + p["transport"])
    assert fits == [False, True]


def test_one_worker_that_trains_and_generates_is_planned_with_either_engine(tiny, tmp_path):
    """With one worker, the actor's group generates with transformers or with vLLM in the trainer's process;
    the engine a plan was estimated with is what --write writes (rollout.backend) and what reads back."""
    from toolkit.placement.planner import write_config as write_plan

    cfg = load_config(write_config(tmp_path, example("tiny-grpo.yaml", tiny)))
    found = search(load_cluster(CLUSTERS / "this-machine.yaml"), workload_of(cfg), 2, strategies=("flattening",))
    assert {c.setting.generation_engine for c in found.fit} == {"hf", "vllm"}
    for engine in ("hf", "vllm"):
        plan = next(c for c in found.fit if c.setting.generation_engine == engine)
        write_plan(cfg, plan, tmp_path / f"{engine}.yaml")
        written = load_config(tmp_path / f"{engine}.yaml")
        assert written.rollout.backend == engine and setting_of(written).generation_engine == engine
        assert (written.rollout.generate_batch_size is None) == (engine == "vllm")


def test_the_critic_on_gpus_of_its_own_trains_at_the_same_time_as_the_actor_by_hand():
    """A critic group of its own (as many ranks as the actor's, on the actor's node): each group holds one
    model's share, and training takes the slower group's seconds (here the two are alike) plus the values
    and the returns crossing between paired ranks: 2 samples a rank x 200 tokens x 4 bytes, each way."""
    w = workload(critic=workload().actor)
    cluster = simple_cluster(shared=False, gpus_per_node=8, nodes=3)
    groups = (Group("generator", ("generation",), 1, 1, 1), Group("scorer", ("reference", "reward"), 1, 1, 1))
    together = Layout("separation", (*groups, Group("trainer", ("actor", "critic"), 1, 4, 1)), 2, 1)
    apart = Layout("separation", (*groups, Group("trainer", ("actor",), 1, 4, 1),
                                  Group("critic", ("critic",), 1, 4, 1, "trainer")), 2, 1)
    assert apart.critic_apart and not together.critic_apart
    assert [g.name for g in apart.trainers] == ["trainer", "critic"]
    one, two = estimate(together, w, cluster), estimate(apart, w, cluster)
    assert two.memory["trainer"] == pytest.approx(trainer_memory(w.actor, w, 4, 2, 1))
    assert two.memory["critic"] == pytest.approx(trainer_memory(w.critic, w, 4, 2, 1))
    assert one.memory["trainer"] == pytest.approx(two.memory["trainer"] + two.memory["critic"])
    assert two.phases["train"] == pytest.approx(one.phases["train"] / 2 + 2 * 2 * 200 * 4 / 1e10)
    assert two.phases["sync"] == one.phases["sync"] and two.phases["generate"] == one.phases["generate"]
    # asynchronous: the critic's group is busy training only (no weight sync)
    lagged = estimate(apart, workload(critic=w.actor, max_policy_lag=1), cluster)
    p = lagged.phases
    assert lagged.step_s == pytest.approx(max(p["generate"] + p["sync"], p["score"], p["train"] + p["sync"])
                                          + p["transport"])


def test_the_planner_puts_the_critic_on_gpus_of_its_own_and_writes_a_config_that_submits(tiny, tmp_path):
    """OpenRLHF's layout on two 8-GPU nodes: vLLM engines on one, 4 actor + 4 critic GPUs on the other. The
    planner weighs it among the plans of a PPO run (with a generator of its own, under any ZeRO stage), and
    writes it as a custom placement that loads and that `submit` maps to Slurm: the critic's tasks on
    the trainer's node, one GPU each."""
    from toolkit.placement.planner import write_config as write_plan

    config = write_config(tmp_path, example("tiny-ppo.yaml", tiny,
                                            model={"dtype": "bfloat16", "actor": eight_heads(tiny, tmp_path)}))
    cfg = load_config(config)
    w = workload_of(cfg, prompt_tokens=256, response_tokens=512,
                    params={"actor": 7e9, "reference": 7e9, "critic": 7e9, "reward": 7e9})
    cluster = load_cluster(CLUSTERS / "2x8-h100.yaml")
    found = search(cluster, w, cfg.trainer.zero_stage, ("colocate_all_models", "separation"), keep=10**6)
    apart = [c for c in found.fit + found.rejected if c.setting.critic_apart]
    assert apart and {c.setting.zero_stage for c in apart} == {1, 2, 3}
    four = [c for c in apart if [(g.name, g.nodes, g.workers, g.same_nodes_as) for g in c.setting.groups]
            == [("generator", 1, 8 // c.setting.tensor_parallel, None), ("trainer", 1, 4, None),
                ("critic", 1, 4, "trainer")]]
    assert four, [c.setting.describe() for c in apart]
    plan = min(four, key=lambda c: (not c.estimate.fits, c.estimate.step_s))
    out = tmp_path / "planned.yaml"
    write_plan(cfg, plan, out)
    written = load_config(out)
    assert written.placement.strategy == "custom"
    critic = written.placement.group_with("critic")
    assert critic.models == ["critic"] and critic.same_nodes_as == "trainer" and critic.workers == 4
    assert written.placement.group_with("actor").workers == 4 and written.trainer.zero_stage == plan.setting.zero_stage
    assert setting_of(written).groups == plan.setting.groups  # (read back as the planner weighed it)
    dry = cli("submit", out, "--dry-run", "--run-dir", tmp_path / "run", timeout=120)
    assert dry.returncode == 0, dry.stdout + dry.stderr
    assert dry.stdout.startswith("placement: a heterogeneous job of 2 components, 2 nodes\n"), dry.stdout
    assert "1 (trainer's)" in dry.stdout  # (the critic's group: on the trainer's node)
    assert ("# component 1: trainer, critic\n#SBATCH --nodes=1\n#SBATCH --ntasks-per-node=8\n"
            "#SBATCH --gpus-per-task=1\n") in dry.stdout, dry.stdout


def test_a_cluster_file_refuses_true_or_false_where_a_number_goes(tmp_path):
    """YAML reads `yes` as true, and pydantic's lax mode took it as 1: `gpus_per_node: yes` planned for one GPU
    a node, silently. A run config refuses it; a cluster file does too, naming the field."""
    text = (CLUSTERS / "2x8-h100.yaml").read_text()
    assert "gpus_per_node: 8\n" in text and load_cluster(CLUSTERS / "2x8-h100.yaml").gpus_per_node == 8
    path = tmp_path / "c.yaml"
    path.write_text(text.replace("gpus_per_node: 8\n", "gpus_per_node: yes\n"))
    with pytest.raises(ConfigError, match=f"{path}: invalid cluster file: gpus_per_node: .*a number goes here, "
                                          "not true or false"):
        load_cluster(path)
    path.write_text(text.replace("gpus_per_node: 8\n", "gpus_per_node: 8\nshared: true\n"))
    assert load_cluster(path).shared is True  # (a bool where a bool goes)


def test_memory_is_planned_for_a_batch_of_the_longest_prompts_and_time_for_the_mean():
    """Prompts of 100 tokens on average but up to 400: a padded micro-batch of 2 holds 2 x (400 + 100) tokens'
    activations when the two longest meet (the mean's 2 x 200 said it fitted where it did not), scoring and
    transformers' generate() likewise, and vLLM must hold one sequence of its whole context (it refuses to start
    otherwise); the step's seconds stay the mean's."""
    mean, varied = workload(), workload(longest_prompt_tokens=400)
    per_token = 10 * 1000 * 17 * 4 + 1000 * 4 * 3  # activations of 10 layers x 1000 hidden, and the logits
    assert trainer_memory(varied.actor, varied, 1, 0, 2) - trainer_memory(varied.actor, varied, 1, 0, 0) == \
        pytest.approx(2 * 500 * per_token)
    assert trainer_memory(mean.actor, mean, 1, 0, 2) - trainer_memory(mean.actor, mean, 1, 0, 0) == \
        pytest.approx(2 * 200 * per_token)
    separation = Layout("separation", (Group("generator", ("generation",)), Group("scorer", ("reference", "reward")),
                                       Group("trainer", ("actor",))), 2, 8)
    a, b = estimate(separation, mean, simple_cluster()), estimate(separation, varied, simple_cluster())
    assert b.memory["scorer"] - a.memory["scorer"] == pytest.approx(8 * 300 * 1000 * 4 * 2)  # forward batch of 8
    assert b.phases == pytest.approx(a.phases)  # (time: the mean sample)
    # vLLM's context of 600 tokens (max_prompt_tokens 500 + 100 new) at 8,000 bytes a token: 4.8 MB, more than a
    # 0.004 GiB budget (4.29 MB) holds, though 3 mean samples of 200 tokens would fit in it
    short = estimate(separation, workload(kv_cache_gb=0.004, max_model_len=600), simple_cluster())
    assert not short.fits and "holds no whole sequence of 600 tokens" in short.short[0]
    assert estimate(separation, workload(kv_cache_gb=0.004), simple_cluster()).fits


def test_the_planned_workload_reads_the_longest_prompt_beside_the_mean(tiny, tmp_path):
    from toolkit.placement.planner import prompt_lengths

    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": " ".join(["word"] * n)}) + "\n" for n in (2, 2, 2, 40)))
    cfg = load_config(write_config(tmp_path, example("tiny-grpo.yaml", tiny, data={"prompts": str(prompts)},
                                                     rollout={"max_prompt_tokens": 30})))
    lengths = prompt_lengths(cfg)
    w = workload_of(cfg)
    assert max(lengths) == 30 and w.longest_prompt_tokens == 30  # (cut at max_prompt_tokens, as the run cuts it)
    assert w.prompt_tokens == pytest.approx(sum(lengths) / len(lengths)) and w.prompt_tokens < 15
    assert w.max_model_len == 30 + cfg.rollout.max_new_tokens
