"""Benchmark of weight sync: slurm-rlhf's bucketed broadcast against one raw torch.distributed broadcast.

    .venv/bin/python tools/bench_sync.py [--repeats N] [--device cuda]

Two processes on this machine form a gloo group over the run's rendezvous store on 127.0.0.1, as trainer
rank 0 and one generator rank do. With `--device cuda` both hold their tensors on the one GPU, as a
trainer and a generator sharing a GPU do: NCCL needs a GPU per rank, so `form_group` takes gloo there
too, which copies each bucket through host memory (NCCL takes gloo's place where the ranks have GPUs of
their own). Per model:
- slurm-rlhf: what the trainer does at every sync, `WeightSender.send`, its weights laid out as DeepSpeed
  ZeRO-1/2 lays them out (views of one flat buffer): the weights in buckets of
  `trainer.weight_sync_bucket_mb` (its default), converted to the checkpoint format vLLM loads, each packed into a
  send buffer and sent as one broadcast, and the probe's log-probs (one forward pass of 8 tokens, the check
  that the generator loaded every weight) computed while the first bucket travels; the receiver takes them
  with `WeightReceiver.receive` (views of each bucket, as vLLM's loader gets them);
  and the same with `rollout.sync_check: false` (no probe: nothing is computed, only the weights travel);
- raw: one `broadcast` of a flat tensor of the same number of bytes, into a new tensor on the receiver
  (as a loader needs each version: vLLM keeps the tensors it is given until a layer is whole), and, for
  the link's bound, into one tensor reused every time.
Both end with a barrier; rank 0's wall time, median over repeats, alternating. Both ranks preload what a
run's workers preload by default (tcmalloc, and on an AMD CPU MKL's library: toolkit/launch/preload.py);
the raw broadcast into a new tensor depends on the allocator (glibc's malloc maps a large tensor anew,
with page faults; tcmalloc reuses the freed one).
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# (torch and the toolkit's weight sync are imported where they are used: `--help` does not wait for them,
# and each spawned rank imports them in rank_main)

# (label, hidden, layers, heads, intermediate, vocab): bench_trl.py's Llama, and a larger one
MODELS = [("Llama (bench_trl)", 512, 8, 8, 1376, 512), ("Llama, 32k vocab", 768, 12, 12, 2048, 32000)]
TIMEOUT_S = 300


def build(hidden: int, layers: int, heads: int, intermediate: int, vocab: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=heads, intermediate_size=intermediate, max_position_embeddings=512,
                         tie_word_embeddings=False)
    return LlamaForCausalLM(config).eval()


def laid_out_as_deepspeed(model):
    """`model` with its weights as views of one flat buffer, in the order of its parameters, as a trainer's
    weights are under DeepSpeed ZeRO-1/2 (which is what lets `WeightSender` send a bucket without a copy)."""
    import torch

    params = list(model.parameters())
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    offset = 0
    for p in params:
        p.data = flat[offset: offset + p.numel()].view_as(p)
        offset += p.numel()
    return model


def rank_main(rank: int, port_queue, results, shape: tuple, repeats: int, device: str) -> None:
    import torch
    import torch.distributed as dist

    from toolkit.config.schema import TrainerSection
    from toolkit.transport.rendezvous import connect_store, serve_store
    from toolkit.transport.wire import new_secret
    from toolkit.weights.hf_format import checkpoint_converter
    from toolkit.weights.probe import model_logprobs, probe_tokens
    from toolkit.weights.sync import WeightReceiver, WeightSender, form_group, gathered_buckets, plan_layout

    bucket_mb = TrainerSection.model_fields["weight_sync_bucket_mb"].default  # (what a run uses)
    torch.set_num_threads(1)
    if rank == 0:  # (the store's key goes to rank 1 with its port, as a run's workers read theirs from a file)
        key = new_secret()
        store = serve_store("127.0.0.1", TIMEOUT_S, key)
        port_queue.put((store.port, key))
    else:
        port, key = port_queue.get(timeout=TIMEOUT_S)
        store = connect_store("127.0.0.1", port, TIMEOUT_S, key)
    device = torch.device(device)
    group = form_group(store, rank, 2, TIMEOUT_S, device)
    unchecked_group = form_group(store, rank, 2, TIMEOUT_S, device, "unchecked")
    raw_group = dist.ProcessGroupGloo(dist.PrefixStore("raw", store), rank, 2, datetime.timedelta(seconds=TIMEOUT_S))
    if rank == 0:
        model = laid_out_as_deepspeed(build(*shape).to(device))
        params = list(model.named_parameters())
        layout = plan_layout(params, bucket_mb * 2**20, probe_tokens(shape[-1], 0), checkpoint_converter(model))
        receiver = unchecked_receiver = None
        sender = WeightSender(layout, device)
        sender.add("0", group)
        unchecked = WeightSender(plan_layout(params, bucket_mb * 2**20, [], checkpoint_converter(model)), device)
        unchecked.add("0", unchecked_group)
        flat = torch.cat([p.detach().reshape(-1) for _, p in params])
    else:
        sender = unchecked = None
        receiver = WeightReceiver(group, device)
        unchecked_receiver = WeightReceiver(unchecked_group, device)
        flat = torch.empty(sum(p.numel() for p in build(*shape).parameters()), device=device)
    ours, off, probe_s, fresh, reused, sent = [], [], [], [], [], 0

    def probe():
        started = time.perf_counter()
        out = model_logprobs(model, layout.probe)
        probe_s.append(time.perf_counter() - started)
        return out

    for version in range(1, repeats + 1):
        for times, send, recv, g in ((ours, sender, receiver, group), (off, unchecked, unchecked_receiver, unchecked_group)):
            g.barrier().wait()
            started = time.perf_counter()
            if rank == 0:
                sent = send.send(version, gathered_buckets([p for _, p in params], layout.sources, False), probe)
            else:
                got, tensors = recv.receive()
                assert got == version
                for _ in tensors:
                    pass
                recv.probe_logprobs()
            g.barrier().wait()
            _synchronize(device)
            times.append(time.perf_counter() - started)
        for times, target in ((fresh, None), (reused, flat)):
            raw_group.barrier().wait()
            started = time.perf_counter()
            raw_group.broadcast(flat if rank == 0 or target is not None else torch.empty_like(flat), 0).wait()
            raw_group.barrier().wait()
            _synchronize(device)
            times.append(time.perf_counter() - started)
    if rank == 0:
        results.put({"ours": statistics.median(ours), "off": statistics.median(off), "probe": statistics.median(probe_s),
                     "fresh": statistics.median(fresh), "reused": statistics.median(reused), "sent": sent,
                     "raw_bytes": flat.numel() * flat.element_size(), "buckets": len(layout.wire),
                     "params": flat.numel()})


def _synchronize(device) -> None:
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="where both processes hold the weights (cuda: the same GPU)")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(f"--repeats {args.repeats}: give 1 or more (the figures are medians over the repeats)")
    from toolkit.launch.preload import as_a_worker

    as_a_worker()  # (both ranks with what a trainer and a generator preload: tcmalloc, MKL's library on AMD)
    import torch
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    where = f"both on {torch.cuda.get_device_name()}, " if args.device == "cuda" else ""
    print(f"Weight sync between two processes over gloo ({where}localhost): slurm-rlhf's bucketed broadcast vs "
          "one raw broadcast of the same bytes")
    header = (f"{'model':<26}{'MB':>7}{'buckets':>8}{'ours s':>8}{'probe s':>9}{'ours MB/s':>10}"
              f"{'raw s':>8}{'raw MB/s':>9}{'ratio':>7}{'no check s':>11}{'ratio':>7}{'raw reused s':>14}")
    print(header + "\n" + "-" * len(header))
    ratios, unchecked = [], []
    for label, *shape in MODELS:
        port_queue, results = ctx.Queue(), ctx.Queue()
        procs = [ctx.Process(target=rank_main, args=(rank, port_queue, results, tuple(shape), args.repeats,
                                                     args.device))
                 for rank in (0, 1)]
        for p in procs:
            p.start()
        try:
            r = results.get(timeout=TIMEOUT_S)
        finally:
            for p in procs:
                p.join(60)
                if p.is_alive():
                    p.kill()
        assert r["sent"] == r["raw_bytes"], r
        mb = r["sent"] / 2**20
        ratios.append(r["fresh"] / r["ours"])
        unchecked.append(r["fresh"] / r["off"])
        label = f"{label} {r['params'] / 1e6:.0f}M"
        print(f"{label:<26}{mb:>7.1f}{r['buckets']:>8}{r['ours']:>8.3f}{r['probe']:>9.3f}{mb / r['ours']:>10.1f}"
              f"{r['fresh']:>8.3f}{mb / r['fresh']:>9.1f}{r['fresh'] / r['ours']:>7.2f}{r['off']:>11.3f}"
              f"{r['fresh'] / r['off']:>7.2f}{r['reused']:>14.3f}")
    print(f"(median of {args.repeats}; ours includes the probe's forward pass, run while the weights travel;\n"
          " no check: rollout.sync_check false, the weights only;\n"
          " raw: one broadcast of the same bytes into a new tensor, as a loader takes each version;\n"
          " raw reused: into the same tensor every time, no page faults; ratio = our MB/s / raw MB/s)\n")
    print(f"ratio {min(ratios):.2f}  (weight sync throughput / raw torch.distributed broadcast, lowest over the models; "
          f"{min(unchecked):.2f} without the sync check)")


if __name__ == "__main__":
    from toolkit.command import run_command

    sys.exit(run_command(main))
