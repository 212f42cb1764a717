"""Peer processes for the weight-sync tests: `python -m tests.integration.peers KIND ARGS...`.

generator CONFIG BACKEND HOST PORT OUT SEQS [REFRESH]
                                               join the sync group as rank 1, record the log-probs of the
                                               whole vocabulary at every position of SEQS, before and
                                               after receiving one version of the weights, the sync check,
                                               and how many frames torch.compile compiled meanwhile
zero3 RANK CONFIG DIR                          a ZeRO-3 trainer rank (of 2): one training step, then sync
receiver CONFIG DIR                            an HF engine that receives the ZeRO-3 trainer's weights
late PORT NAME SECONDS                         rank 1 of weight-sync group NAME that, once in it, waits
                                               SECONDS before it takes part in an all-reduce of [1, 2, 3]
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time
from pathlib import Path

BUCKET_BYTES = 64 * 1024  # small buckets: the tiny model's 1.8 MB go in many pieces


def _engine(config: str, backend: str):
    import torch

    from toolkit.config import load_config
    from toolkit.roles.engines import make_engine

    return make_engine(backend, load_config(config), torch.device("cpu"))


def generator(config, backend, host, port, out, seqs, refresh="refresh") -> None:
    """`refresh` other than "refresh": vLLM's reload without the extension's repair of derived weights
    (a fault put in on purpose, to show that the sync check finds it)."""
    from toolkit.weights import probe

    if refresh != "refresh":
        import toolkit.weights.vllm_extension as extension

        extension._refresh_derived = lambda model: None
    engine = _engine(config, backend)
    joined = engine.join_weight_sync(host, int(port), 1, 2, 120)
    sequences = json.loads(Path(seqs).read_text())
    before = [engine.prompt_logprobs(s, top=-1) for s in sequences]
    version, expected = engine.receive_weights()
    after = [engine.prompt_logprobs(s, top=-1) for s in sequences]
    try:
        check = None if not joined["probe"] else (  # (no probe: rollout.sync_check is off)
            probe.check(expected, probe.engine_logprobs(engine, joined["probe"]), 1e-3, version, "the peer"))
    except probe.WeightSyncError as e:
        check = str(e)
    from torch._dynamo.utils import counters

    as_json = lambda runs: [[{str(k): v for k, v in pos.items()} for pos in run] for run in runs]  # noqa: E731
    Path(out).write_text(json.dumps({"version": version, "before": as_json(before), "after": as_json(after),
                                     "weights": joined["weights"], "check": check,
                                     "compiled_frames": counters["frames"]["total"]}))


def _wait_port(directory: Path) -> int:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if (directory / "port").exists() and (directory / "port").read_text().strip():
            return int((directory / "port").read_text())
        time.sleep(0.1)
    raise TimeoutError("no store port from rank 0")


def zero3(rank, config, directory) -> None:
    import deepspeed
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from toolkit.config import load_config
    from toolkit.transport.rendezvous import connect_store, serve_store
    from toolkit.weights.probe import model_logprobs, probe_tokens
    from toolkit.weights.sync import WeightSender, form_group, gathered_buckets, plan_layout

    rank, directory = int(rank), Path(directory)
    cfg = load_config(config)
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK="0")
    timeout = datetime.timedelta(seconds=120)
    if rank == 0:
        store = serve_store("127.0.0.1", 120)
        (directory / "port.tmp").write_text(str(store.port))
        os.replace(directory / "port.tmp", directory / "port")
    else:
        store = connect_store("127.0.0.1", _wait_port(directory), 120)
    dist.init_process_group("gloo", store=dist.PrefixStore("trainer", store), rank=rank, world_size=2, timeout=timeout)
    model = AutoModelForCausalLM.from_pretrained(cfg.model.actor, dtype=torch.float32)
    ds_config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "train_batch_size": 4,
                 "zero_optimization": {"stage": 3}, "zero_allow_untested_optimizer": True,
                 "steps_per_print": 2**31 - 1}
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
                                      config=ds_config)
    torch.manual_seed(rank)
    ids = torch.randint(3, 500, (2, 12))
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    params = list(engine.module.named_parameters())
    partitioned = all(p.ds_tensor.numel() < p.ds_numel for _, p in params if p.ds_numel > 1000)
    layout = plan_layout(params, BUCKET_BYTES, probe_tokens(500, 0))
    def probe():  # (a forward pass: every ZeRO-3 rank takes part)
        return model_logprobs(engine.module, layout.probe)

    if rank == 0:
        sender = WeightSender(layout, torch.device("cpu"))
        sender.add("0", form_group(store, 0, 2, 120, torch.device("cpu")))
        sender.send(1, gathered_buckets([p for _, p in params], layout.sources, zero3=True), probe, transient=True)
    else:
        for _ in gathered_buckets([p for _, p in params], layout.sources, zero3=True):
            pass
        probe()
    with deepspeed.zero.GatheredParameters([p for _, p in params], modifier_rank=None):
        if rank == 0:
            torch.save({n: p.data.clone() for n, p in params}, directory / "expected.pt")
            (directory / "partitioned").write_text(str(partitioned))
    dist.barrier()


def receiver(config, directory) -> None:
    import torch

    directory = Path(directory)
    engine = _engine(config, "hf")
    joined = engine.join_weight_sync("127.0.0.1", _wait_port(directory), 1, 2, 120)
    version, expected = engine.receive_weights()
    from toolkit.weights import probe

    probe.check(expected, probe.engine_logprobs(engine, joined["probe"]), 1e-5, version, "the receiver")
    torch.save({"version": version, "weights": {n: p.data.clone() for n, p in engine.model.named_parameters()}},
               directory / "received.pt")


def late(port, name, seconds) -> None:
    import torch

    from toolkit.transport.rendezvous import connect_store
    from toolkit.weights.sync import form_group

    store = connect_store("127.0.0.1", int(port), 120)
    group = form_group(store, 1, 2, 120, torch.device("cpu"), name)
    time.sleep(float(seconds))
    group.allreduce([torch.tensor([1.0, 2.0, 3.0])]).wait()


if __name__ == "__main__":
    kind, *args = sys.argv[1:]
    {"generator": generator, "zero3": zero3, "receiver": receiver, "late": late}[kind](*args)
