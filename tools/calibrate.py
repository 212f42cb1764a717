"""Measure this machine's rates and per-call costs for the placement planner; write a cluster file.

    python tools/calibrate.py [--config templates/examples/tiny-grpo.yaml] [--out templates/clusters/this-machine.yaml]

Each figure is measured on its own, in this one process, never from a whole RL run (tools/bench_placement.py
then checks the planner's predictions against whole runs):
  flops, memory_bandwidth   a large fp32 matmul; a large tensor copy
  intra_node, latency_s     ZeroMQ over TCP loopback: a 16 MB message, and small ones
  decode_step_hf/_vllm      generation of the config's model at two batch sizes: the time beyond the FLOP
                            and byte terms, split into a per-step and a per-sequence part
  forward_call              no-gradient forward passes (log-probs) beyond their FLOPs
  train_micro_batch, optimizer_step   DeepSpeed updates with two micro-batch sizes, beyond their FLOPs
  message, step             one samples message (encode, MAC, send, decode); one HDF5 experience commit
  generation_idle           the share of the cores vLLM's generation leaves idle: a probe process per core
                            (pinned, nice 19) multiplies matrices beside it, against the same probes alone
Run it with the thread count the runs will have (default: every core).
"""

from __future__ import annotations

import argparse
import os
import select
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def best_of(fn, repeat: int = 5) -> float:
    fn()  # warm up
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return min(times) if repeat < 5 else statistics.median(times)


def machine_rates(torch) -> dict:
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    flops = 2 * 1024**3 / best_of(lambda: a @ b, 9)
    x = torch.empty(64 * 2**20 // 4)
    y = torch.empty_like(x)
    bandwidth = 2 * x.numel() * 4 / best_of(lambda: y.copy_(x), 9)  # read + write
    return {"flops": flops, "memory_bandwidth": bandwidth}


def zmq_rates() -> dict:
    import numpy as np
    import zmq

    from toolkit.transport.wire import Codec

    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    push.connect(f"tcp://127.0.0.1:{port}")
    codec = Codec(os.urandom(32), "calibrate")

    def send(arrays):
        push.send_multipart(codec.encode("samples", {"step": 0}, arrays), copy=False)
        codec.decode(pull.recv_multipart(copy=False))

    big = {"x": np.zeros(16 * 2**20, np.uint8)}
    bandwidth = big["x"].nbytes / best_of(lambda: send(big), 5)
    latency = best_of(lambda: send({"x": np.zeros(8, np.uint8)}), 9)
    push.close(0)
    pull.close(0)
    ctx.term()
    return {"intra_node": bandwidth, "latency_s": latency}


def idle_probe(core: int) -> int:
    """`--idle-probe CORE`: one thread on CORE at nice 19 multiplying matrices from a line `go` on stdin to a
    line `stop`, then printing how many a second. Beside other work it gets what that work leaves idle."""
    import threading

    os.sched_setaffinity(0, {core})
    os.nice(19)
    import torch

    torch.set_num_threads(1)
    a = torch.randn(256, 256)
    stop = threading.Event()
    print("ready", flush=True)
    sys.stdin.readline()
    threading.Thread(target=lambda: (sys.stdin.readline(), stop.set()), daemon=True).start()
    count, started = 0, time.perf_counter()
    while not stop.is_set():
        a @ a
        count += 1
    print(count / (time.perf_counter() - started), flush=True)
    return 0


def probes_rate(cores: list[int], during, timeout_s: float = 120.0) -> float:
    """Matmuls a second of one `idle_probe` per core while `during()` runs."""
    procs = [subprocess.Popen([sys.executable, __file__, "--idle-probe", str(c)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True) for c in cores]

    def line(p) -> str:
        if not select.select([p.stdout], [], [], timeout_s)[0]:
            raise TimeoutError(f"an idle probe said nothing in {timeout_s:g} s")
        return p.stdout.readline().strip()

    try:
        for p in procs:
            if line(p) != "ready":
                raise RuntimeError("an idle probe failed to start")
        for word in ("go", "stop"):
            for p in procs:
                p.stdin.write(word + "\n")
                p.stdin.flush()
            if word == "go":
                during()
        return sum(float(line(p)) for p in procs)
    finally:
        for p in procs:
            p.kill()
            p.wait()


def generation_idle(engine, prompts, cores: list[int], seconds: float = 5.0) -> float:
    """The share of `cores` that `engine` generating `prompts` (again and again, `seconds` long) leaves to
    other work: the probes' rate beside it over their rate alone."""
    def generate():
        until = time.monotonic() + seconds
        while time.monotonic() < until:
            engine.generate(prompts, list(range(len(prompts))))

    alone = probes_rate(cores, lambda: time.sleep(seconds))
    beside = probes_rate(cores, generate)
    return min(max(beside / alone, 0.0), 0.95)


def main() -> int:
    if sys.argv[1:2] == ["--idle-probe"]:
        return idle_probe(int(sys.argv[2]))
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(REPO / "templates/examples/tiny-grpo.yaml"))
    parser.add_argument("--out", type=Path, help="cluster file to write (default: print it)")
    parser.add_argument("--memory-gb", type=float, help="memory of the machine (default: read from /proc/meminfo)")
    args = parser.parse_args()
    from toolkit.launch.preload import as_a_worker

    # (what a worker preloads by default: tcmalloc, and on an AMD CPU MKL's library, which doubles MKL's
    # matrix products there; measured without them, the rates would not be the workers')
    as_a_worker()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from toolkit.launch.openmp import wait_passively

    wait_passively()  # (as in every process of a run; OpenMP threads that spin would leave no core idle)

    import numpy as np
    import torch
    import yaml

    from toolkit.config import load_config
    from toolkit.placement.cost import ModelShape
    from toolkit.placement.planner import prompt_tokens_of

    cfg = load_config(args.config)
    cores = sorted(os.sched_getaffinity(0))  # (before vLLM pins this process's threads)
    shape = ModelShape.from_config(cfg.model.actor)
    P, b = shape.params, 4
    rates = machine_rates(torch)
    F, B = rates["flops"], rates["memory_bandwidth"]
    links = zmq_rates()
    print(f"matmul {F / 1e9:.1f} GFLOP/s, copy {B / 1e9:.1f} GB/s, ZeroMQ {links['intra_node'] / 1e9:.2f} GB/s, "
          f"{links['latency_s'] * 1e3:.2f} ms per small message", file=sys.stderr)

    # The run's own prompts: their spread of lengths (padding) is part of what a call costs.
    from transformers import AutoTokenizer

    from toolkit.data.prompts import read_prompts
    from toolkit.data.tokens import render_prompt

    tokenizer = AutoTokenizer.from_pretrained(cfg.tokenizer_path)
    real = [render_prompt(tokenizer, p.prompt, cfg.data.chat_template)[-cfg.rollout.max_prompt_tokens:]
            for p in read_prompts(cfg.data, cfg.run.seed).next(64)]
    lp, _ = prompt_tokens_of(cfg)
    lr = cfg.rollout.max_new_tokens

    def prompts_of(n: int) -> list[list[int]]:
        return [real[i % len(real)] for i in range(n)]

    def decode_costs(engine) -> tuple[float, float]:
        """(per step, per sequence and step) beyond FLOPs and bytes, from batches of 16 and 64 samples."""
        extra = {}
        for n in (16, 64):
            seconds = best_of(lambda: engine.generate(prompts_of(n), list(range(n))), 3)
            tokens = statistics.mean(len(c.tokens) for c in engine.generate(prompts_of(n), list(range(n))))
            kv = n * (lp + tokens / 2) * shape.kv_bytes_per_token(b)
            model_s = 2 * P * n * lp / F + tokens * max(2 * P * n / F, (P * b + kv) / B)
            extra[n] = (seconds - model_s) / tokens
        per_sequence = max((extra[64] - extra[16]) / 48, 0.0)
        return max(extra[16] - 16 * per_sequence, 0.0), per_sequence

    from toolkit.roles.engines.hf_engine import HFEngine

    hf = HFEngine(cfg, torch.device("cpu"))
    hf_step, hf_seq = decode_costs(hf)

    # Forward passes and DeepSpeed updates on random samples of the run's lengths.
    from transformers import AutoModelForCausalLM

    from toolkit.modeling import pad_samples, sequence_logprobs
    from toolkit.samples import SampleBatch, ragged
    from toolkit.roles.update import Experience, train_on
    from toolkit.training.engine import build_engine
    from toolkit.training.ranks import alone

    n = cfg.samples_per_step
    g = torch.Generator().manual_seed(0)
    responses = [torch.randint(3, shape.vocab, (lr,), generator=g).tolist() for _ in range(n)]
    pt, po = ragged(prompts_of(n), np.int32)
    rt, ro = ragged(responses, np.int32)
    batch = SampleBatch(0, np.arange(n), np.arange(n, dtype=np.int32), np.zeros(n, np.int32), np.zeros(n, np.int32),
                        pt, po, rt, ro, np.zeros(len(rt), np.float32), np.ones(n, bool))
    padded = pad_samples(batch, 0)
    tokens = n * (lp + lr)
    model = AutoModelForCausalLM.from_pretrained(cfg.model.actor, dtype=torch.float32).eval()
    fbs = cfg.model.forward_batch_size
    calls = -(-n // fbs)
    forward_s = best_of(lambda: sequence_logprobs(model, padded, 1.0, fbs), 5)
    forward_call = max((forward_s - 2 * P * tokens / F) / calls, 0.0)

    alone(torch.device("cpu"))
    mask = padded.action_mask
    zeros = torch.zeros_like(mask)
    exp = Experience(padded, zeros, zeros, zeros, torch.randn(mask.shape, generator=g) * mask)
    per_update = {}
    for mb in (8, 16):
        run_cfg = cfg.model_copy(update={"trainer": cfg.trainer.model_copy(update={"micro_batch_size": mb})})
        t = run_cfg.trainer
        accumulation = n // (t.micro_batch_size * t.updates_per_step)
        engine = build_engine(AutoModelForCausalLM.from_pretrained(cfg.model.actor), t, 1e-6, "float32", 1, accumulation)
        seconds = best_of(lambda: train_on(exp, engine, None, run_cfg, g), 3)
        per_update[mb] = seconds - 6 * P * tokens / F - 16 * P / B
    train_micro_batch = max((per_update[8] - per_update[16]) / (n / 8 - n / 16), 0.0)
    optimizer_step = max(per_update[16] - n / 16 * train_micro_batch, 0.0)
    print(f"forward call {forward_call * 1e3:.2f} ms, micro-batch {train_micro_batch * 1e3:.2f} ms, "
          f"optimizer step {optimizer_step * 1e3:.2f} ms", file=sys.stderr)

    # One samples message, and the experience commit the trainer makes every step.
    import zmq

    from toolkit.store import experience
    from toolkit.transport.wire import Codec

    codec = Codec(os.urandom(32), "calibrate")
    batch.ref_logprobs = batch.behaviour_logprobs.copy()
    batch.rewards = np.zeros((n, 1), np.float32)
    batch.prompts, batch.responses, batch.fields = ["x" * 40] * n, ["y" * 40] * n, [{}] * n
    batch.reward_names, batch.reward_weights = ["r"], [1.0]
    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    push.connect(f"tcp://127.0.0.1:{port}")
    message = best_of(lambda: (push.send_multipart(codec.encode(*batch.to_message()), copy=False),
                               SampleBatch.from_message(codec.decode(pull.recv_multipart(copy=False)))), 9)
    flat = np.zeros(len(rt), np.float32)
    record = experience.record_of(batch, {"old_logprobs": flat, "advantages": flat}, "grpo", 1, 0.0, n)
    with tempfile.TemporaryDirectory() as d:
        step = best_of(lambda: experience.commit(Path(d), 0, record), 5)
    print(f"samples message {message * 1e3:.2f} ms, experience commit {step * 1e3:.2f} ms", file=sys.stderr)

    # vLLM last: it pins this process's threads to cores, which would change the figures above.
    vllm_step, vllm_seq, generator = hf_step, hf_seq, hf
    try:
        from toolkit.roles.engines.vllm_engine import VllmEngine

        generator = VllmEngine(cfg, torch.device("cpu"))
        vllm_step, vllm_seq = decode_costs(generator)
    except ImportError:
        print("vLLM is not installed: decode_step_vllm and generation_idle are the transformers figures",
              file=sys.stderr)
    print(f"decode step: transformers {hf_step * 1e3:.2f} ms + {hf_seq * 1e6:.1f} us/sequence, "
          f"vLLM {vllm_step * 1e3:.2f} ms + {vllm_seq * 1e6:.1f} us/sequence", file=sys.stderr)
    idle = round(generation_idle(generator, prompts_of(cfg.samples_per_step), cores), 2)  # (as written)
    print(f"generation leaves {idle:.0%} of {len(cores)} core(s) idle", file=sys.stderr)

    memory_gb = args.memory_gb or _meminfo_gb()
    cluster = {
        "name": f"this machine ({os.cpu_count()} cores, {torch.get_num_threads()} threads, {memory_gb:.0f} GB)",
        "nodes": 1, "gpus_per_node": 0, "shared": True,
        "device": {"memory_gb": round(memory_gb, 1), "flops": float(f"{F:.3g}"), "memory_bandwidth": float(f"{B:.3g}"),
                   "generation_idle": idle},
        "links": {"intra_node": float(f"{links['intra_node']:.3g}"), "inter_node": float(f"{links['intra_node']:.3g}"),
                  "latency_s": float(f"{links['latency_s']:.3g}")},
        "overheads": {k: float(f"{v:.3g}") for k, v in {
            "decode_step_vllm": vllm_step, "decode_step_hf": hf_step,
            "decode_per_sequence_vllm": vllm_seq, "decode_per_sequence_hf": hf_seq,
            "forward_call": forward_call, "train_micro_batch": train_micro_batch, "optimizer_step": optimizer_step,
            "message": message, "step": step}.items()},
        "measured": f"python tools/calibrate.py --config {os.path.relpath(args.config, REPO)} on "
                    f"{time.strftime('%Y-%m-%d')} ({socket.gethostname()})",
    }
    text = ("# Written by tools/calibrate.py: rates and per-call costs measured on this machine.\n"
            + yaml.safe_dump(cluster, sort_keys=False))
    if args.out:
        args.out.write_text(text)
        print(f"wrote {args.out}", file=sys.stderr)
    else:
        print(text, end="")
    return 0


def _meminfo_gb() -> float:
    with open("/proc/meminfo") as f:
        kb = next(int(line.split()[1]) for line in f if line.startswith("MemTotal:"))
    return kb / 1e6


if __name__ == "__main__":
    from toolkit.command import run_command

    sys.exit(run_command(main))
