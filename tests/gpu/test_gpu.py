"""The GPU path, run where CUDA is present (`pytest -m gpu`; skipped elsewhere, as in CI, which has no GPU).

On one GPU, a model of a public architecture (Qwen2.5-0.5B's config, random weights):
- DeepSpeed bf16 training with and without each memory switch (tools/bench_memory.py): what each saves
  in peak GPU memory, and that the losses stay the baseline's;
- the trainer's state leaving the GPU between updates (`placement.offload`, `training.engine.park`);
- weight sync between two processes on the one GPU (gloo copies through host memory: NCCL needs a GPU
  per rank), checked as a generator checks it, by the probe's log-probs;
- a whole GRPO run in Flattening on the one GPU.

`SLURM_RLHF_GPU_TESTS_ON_CPU=1` runs the same code on the CPU (the GPU figures are then not asserted):
a way to check these tests on a machine without a GPU before taking them to one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO, cli, example, write_config

ON_CPU = os.environ.get("SLURM_RLHF_GPU_TESTS_ON_CPU") == "1"
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not (torch.cuda.is_available() or ON_CPU), reason="needs a GPU")]
DEVICE = torch.device("cpu" if ON_CPU else "cuda")
QWEN = REPO / "tests" / "fixtures" / "model_configs" / "Qwen--Qwen2.5-0.5B.json"


def qwen_config(**changes) -> dict:
    """Qwen2.5-0.5B's config.json, with `changes`."""
    fields = json.loads(QWEN.read_text())
    for key in ("torch_dtype", "transformers_version"):
        fields.pop(key, None)
    return {**fields, **changes}


def two_layer_model():
    """Qwen2.5-0.5B's architecture cut to 2 layers and the tiny tokenizer's 512 tokens, random weights (fp32)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(AutoConfig.for_model(**qwen_config(
        num_hidden_layers=2, max_window_layers=2, vocab_size=512, bos_token_id=1, eos_token_id=2)))


def bench_memory(directory: Path, dtype: str, settings: str) -> dict[str, dict]:
    """bench_memory's figures for Qwen2.5-0.5B's shape cut to 4 layers, in `dtype` on the GPU."""
    config = directory / "config.json"
    config.write_text(json.dumps(qwen_config(num_hidden_layers=4, max_window_layers=4)))
    out = directory / "figures.json"
    done = subprocess.run([sys.executable, "tools/bench_memory.py", f"--config={config}", "--batch=4", "--seq=512",
                           "--steps=3", f"--dtype={dtype}", f"--device={DEVICE.type}", f"--json={out}",
                           f"--settings={settings}"], cwd=REPO, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stdout + done.stderr
    print(done.stdout)
    return {r["setting"]: r for r in json.loads(out.read_text())}


@pytest.fixture(scope="module")
def figures(tmp_path_factory) -> dict[str, dict]:
    return bench_memory(tmp_path_factory.mktemp("bench"), "bfloat16", "baseline,checkpointing,offload_optimizer,lora")


def test_bf16_training_with_each_memory_switch(figures):
    base = figures["baseline"]
    for name in ("checkpointing", "offload_optimizer"):  # the same weights trained: the same losses (bf16)
        assert max(abs(a - b) for a, b in zip(figures[name]["losses"], base["losses"])) < 0.05, name
    assert abs(figures["lora"]["losses"][0] - base["losses"][0]) < 0.05  # (its first step: the same model)
    assert figures["lora"]["trainable"] < 0.02 * base["trainable"]
    # (the 151,936-token vocabulary's logits, which checkpointing keeps, are most of what a 4-layer model keeps)
    assert figures["checkpointing"]["saved_activation_bytes"] < 0.9 * base["saved_activation_bytes"]
    if DEVICE.type != "cuda":
        return
    assert all(0.0 < r["mfu"] < 1.0 for r in figures.values())
    # What leaves the GPU: ZeRO-Offload, Adam's two states and the fp32 master weights (12 bytes a
    # weight); LoRA, all of those but the adapters'; checkpointing, most activations.
    states_mb = 12 * base["trainable"] / 2**20
    assert figures["offload_optimizer"]["peak_device_mb"] < base["peak_device_mb"] - 0.8 * states_mb
    assert figures["lora"]["peak_device_mb"] < base["peak_device_mb"] - 0.8 * states_mb
    assert figures["checkpointing"]["peak_device_mb"] < base["peak_device_mb"]


@pytest.mark.skipif(ON_CPU, reason="DeepSpeed's fp16 mode needs a GPU")
def test_fp16_training_with_loss_scaling(figures, tmp_path):
    """DeepSpeed's fp16 mode (fp32 master weights, dynamic loss scaling): the first loss is bf16's (the same
    model and tokens), not every step is dropped on an overflow, and each switch keeps the fp16 baseline's
    losses (LoRA: its first)."""
    fp16 = bench_memory(tmp_path, "float16", "baseline,checkpointing,lora")
    base = fp16["baseline"]
    assert all(r["skipped_steps"] < len(r["losses"]) for r in fp16.values()), fp16
    assert abs(base["losses"][0] - figures["baseline"]["losses"][0]) < 0.05
    assert max(abs(a - b) for a, b in zip(fp16["checkpointing"]["losses"], base["losses"])) < 0.02
    assert abs(fp16["lora"]["losses"][0] - base["losses"][0]) < 0.02
    assert fp16["lora"]["peak_device_mb"] < base["peak_device_mb"]


def _engine(seed: int):
    from toolkit.config.base import EngineSection
    from toolkit.training.engine import build_engine

    torch.manual_seed(seed)
    model = two_layer_model().to(torch.bfloat16)
    return build_engine(model, EngineSection(zero_stage=2, lr=1e-3, micro_batch_size=4), 1e-3, "bfloat16", 1, 1)


def test_the_trainers_state_leaves_the_gpu_between_updates_and_trains_the_same(monkeypatch):
    from toolkit.training.engine import park, unpark

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29561")
    for name in ("RANK", "LOCAL_RANK"):
        monkeypatch.setenv(name, "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    batches = [torch.randint(0, 512, (4, 128), generator=torch.Generator().manual_seed(i)) for i in range(3)]
    losses, moved = {}, []
    for parking in (False, True):
        engine = _engine(0)
        weights = sum(p.numel() for p in engine.module.parameters())
        losses[parking] = []
        for i, ids in enumerate(batches):
            if parking and i:
                unpark(engine)
            ids = ids.to(engine.device)
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            losses[parking].append(loss.item())
            if parking:
                before = torch.cuda.memory_allocated() if DEVICE.type == "cuda" else 0
                assert park(engine)
                moved.append(before - (torch.cuda.memory_allocated() if DEVICE.type == "cuda" else 0))
        del engine
    # (the same arithmetic on the same device; on a GPU, attention's backward adds up in any order)
    tolerance = 2e-3 if DEVICE.type == "cuda" else 0.0
    assert all(abs(a - b) <= tolerance for a, b in zip(losses[True], losses[False])), losses
    if DEVICE.type == "cuda":
        print(f"parked {moved[0] / 2**20:.0f} MB of {weights / 1e6:.1f}M weights' training state")
        assert min(moved) > 0.9 * 12 * weights  # Adam's two states and the fp32 master weights at least


def _sync_rank(rank: int, port_queue, results, device: str) -> None:
    """Trainer (rank 0) or generator (rank 1) of a weight-sync group, both on `device`."""
    from toolkit.transport.rendezvous import connect_store, serve_store
    from toolkit.transport.wire import new_secret
    from toolkit.weights.probe import model_logprobs, probe_tokens
    from toolkit.weights.sync import WeightReceiver, WeightSender, form_group, gathered_buckets, plan_layout

    device = torch.device(device)
    if rank == 0:
        key = new_secret()
        store = serve_store("127.0.0.1", 120, key)
        port_queue.put((store.port, key))
    else:
        port, key = port_queue.get(timeout=120)
        store = connect_store("127.0.0.1", port, 120, key)
    group = form_group(store, rank, 2, 120, device)
    torch.manual_seed(rank)  # (different weights on each side before the sync)
    model = two_layer_model().to(device)
    params = list(model.named_parameters())
    if rank == 0:
        layout = plan_layout(params, 8 * 2**20, probe_tokens(512, 0))
        sender = WeightSender(layout, device)
        sender.add("0", group)
        sent = sender.send(1, gathered_buckets([p for _, p in params], layout.sources, False),
                           lambda: model_logprobs(model, layout.probe))
        results.put({"sent": sent, "backend": group.name()})
        return
    receiver = WeightReceiver(group, device)
    version, tensors = receiver.receive()
    mine = dict(params)
    with torch.no_grad():
        for name, tensor in tensors:
            assert tensor.device.type == device.type
            mine[name].copy_(tensor)
    expected = receiver.probe_logprobs()
    got = model_logprobs(model, receiver.probe)
    results.put({"version": version, "probe_diff": float((got - expected.cpu()).abs().max())})


def test_weight_sync_between_two_processes_on_one_gpu():
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    port_queue, results = ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=_sync_rank, args=(rank, port_queue, results, DEVICE.type)) for rank in (0, 1)]
    for p in procs:
        p.start()
    try:
        got = []
        for _ in range(300):  # (a rank that dies fails the test at once, not after the wait)
            while not results.empty():
                got.append(results.get())
            if len(got) == len(procs):
                break
            dead = [p.exitcode for p in procs if p.exitcode]
            assert not dead, f"a sync rank exited with {dead} (its traceback is above)"
            time.sleep(1)
        assert len(got) == len(procs), f"the sync ranks gave {len(got)} of {len(procs)} results in 300 s"
    finally:
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()
    sender = next(r for r in got if "sent" in r)
    receiver = next(r for r in got if "version" in r)
    assert sender["backend"] == "gloo"  # (both ranks on the one GPU: NCCL would refuse them)
    assert sender["sent"] > 0 and receiver["version"] == 1
    assert receiver["probe_diff"] < 1e-4, receiver


@pytest.mark.skipif(ON_CPU, reason="NCCL needs a GPU")
def test_an_nccl_group_forms_over_the_runs_own_store():
    """NCCL's C++ side against the run's rendezvous store (a Python torch.distributed.Store behind the
    run's key): the group takes NCCL for a rank with a GPU of its own and its collectives run, and the
    trainer's sender waits for its transfers within the timeout (a host wait). One rank: NCCL refuses two
    ranks on one GPU, so a group of two needs a second GPU."""
    from toolkit.transport.rendezvous import serve_store
    from toolkit.transport.wire import new_secret
    from toolkit.weights.sync import WeightSender, form_group, gathered_buckets, plan_layout

    before = os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING")
    store = serve_store("127.0.0.1", 60, new_secret())
    group = sender = None
    try:
        group = form_group(store, 0, 1, 60, DEVICE)
        assert group.name() == "nccl" and os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING") == before
        weights = torch.arange(1 << 20, dtype=torch.bfloat16, device=DEVICE)
        expected = weights.clone()
        group.broadcast(weights, 0).wait()
        group.allreduce([weights]).wait()
        torch.cuda.synchronize()
        assert torch.equal(weights, expected)
        assert store.num_keys() >= 1  # (at least form_group's choice of backend went through the store)
        model = two_layer_model().to(DEVICE)
        params = list(model.named_parameters())
        layout = plan_layout(params, 8 * 2**20, [])
        sender = WeightSender(layout, DEVICE)
        sender.add("0", group, 60)
        sent = sender.send(1, gathered_buckets([p for _, p in params], layout.sources, False), lambda: None)
        assert sent == sum(p.numel() * p.element_size() for _, p in params)
        assert sender.lost == [] and sender.limits["0"].total_seconds() == 60
    finally:
        group = sender = None  # (the group goes before the store: NCCL's monitor thread reads the store)
        store.close()


@pytest.fixture(scope="module")
def qwen_actor(tiny, tmp_path_factory) -> Path:
    """Qwen2.5-0.5B's architecture with the tiny tokenizer's 512-token vocabulary, random weights, bf16."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    directory = tmp_path_factory.mktemp("qwen") / "model"
    tokenizer = AutoTokenizer.from_pretrained(tiny / "model")
    torch.manual_seed(0)
    config = AutoConfig.for_model(**qwen_config(vocab_size=512, bos_token_id=tokenizer.bos_token_id,
                                                eos_token_id=tokenizer.eos_token_id))
    AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def test_a_grpo_run_in_flattening_on_one_gpu(tiny, qwen_actor, tmp_path):
    data = example("tiny-grpo.yaml", tiny, placement={"strategy": "flattening", "offload": True,
                                                      "all": {"gpus_per_worker": 1}})
    data["model"].update(actor=str(qwen_actor), dtype="bfloat16")
    data["run"].update(steps=3, name="gpu-flattening")
    data["rollout"]["backend"] = "hf"
    run_dir = tmp_path / "run"
    result = cli("run", write_config(tmp_path / "config", data), "--run-dir", run_dir, timeout=900)
    assert result.returncode == 0, result.stdout + result.stderr
    assert json.loads((run_dir / "status.json").read_text())["state"] == "finished"
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    print("\n".join(json.dumps({k: r.get(k) for k in ("step", "generate_s", "score_s", "train_s", "park_s", "step_s",
                                                        "behaviour_logprob_diff", "loss", "reward_mean")})
                    for r in records))
    assert [r["policy_version"] for r in records] == [1, 2, 3]
    assert all(r["park_s"] > 0 for r in records[:-1])
    # the actor generates with its own weights: the generator's log-probs are the trainer's, up to bf16
    # (generation's cached keys and values against one forward pass over the whole sequence)
    assert all(r["behaviour_logprob_diff"] < 0.05 for r in records), [r["behaviour_logprob_diff"] for r in records]
    log = (run_dir / "logs" / "all-0.log").read_text()
    assert f"trainer rank 0/1 ready (actor, ZeRO-2, 290 actor weights, policy_version 0) on {DEVICE}" in log, log


def test_generate_with_transformers_samples_on_the_gpu(qwen_actor, tmp_path):
    """`generate --backend hf` (the engine where vLLM is not installed, as on the lent GPU machine) samples
    on the GPU: a batch of rows of different prompts, each drawn with its own seeded generator there, the
    same as each row alone; greedy takes the model's argmax at every position."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "1 2 3"}\n{"prompt": "count to nine, then say hello"}\n')

    def generate(*args) -> list[dict]:
        result = cli("generate", qwen_actor, "--input", prompts, "--backend", "hf", "--max-new-tokens", 16, *args)
        assert result.returncode == 0, result.stderr
        return [json.loads(line) for line in result.stdout.splitlines()]

    from toolkit.use.sampler import Sampler, Sampling

    sampler = Sampler(qwen_actor, "hf", 64, seed=0)
    assert sampler.device.type == DEVICE.type
    tokens = [sampler.tokenizer(t)["input_ids"] for t in ("1 2 3", "count to nine, then say hello")]
    both = sampler.sample(tokens, Sampling(max_new_tokens=16, temperature=1.0, n=2))
    alone = sampler.sample(tokens[1:], Sampling(max_new_tokens=16, temperature=1.0, n=2), first_index=1)
    assert [s.token_ids for s in both[1]] == [s.token_ids for s in alone[0]]
    assert generate("--n", 2, "--temperature", 1)[2:] == generate("--n", 2, "--temperature", 1)[2:]
    greedy = sampler.sample(tokens, Sampling(max_new_tokens=16, temperature=0.0))
    for prompt, (sample,) in zip(tokens, greedy):
        with torch.no_grad():
            ids = torch.tensor([prompt + sample.token_ids], device=sampler.device)
            logits = sampler.model(input_ids=ids).logits[0, len(prompt) - 1:-1].float()
        chosen = logits.gather(-1, torch.tensor(sample.token_ids, device=sampler.device)[:, None])[:, 0]
        # (bf16: generation's cached keys and values against one pass over the whole sequence can swap
        # near ties, so the chosen token's logit is the largest within bf16's rounding)
        assert float((logits.max(-1).values - chosen).max()) < 0.05
