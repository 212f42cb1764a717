"""Benchmark of rollout streaming: slurm-rlhf's ZeroMQ transport against raw pyzmq, same payloads.

    .venv/bin/python tools/bench_transport.py [--repeats N] [--steps N]

1. Throughput: a sender process streams SampleBatch messages to a receiver process over TCP on
   localhost, the way a generator or scorer sends samples on: `Outbox.send(*batch.to_message())` and
   `SampleBatch.from_message(Inbox.recv())` (msgpack header, GMAC tag over every frame, sequence and
   size checks). Beside it, the same bytes with raw pyzmq: PUSH/PULL, `send_multipart([msgpack header,
   *array buffers], copy=False)`, `np.frombuffer` on receipt, no authentication. Payloads: the batch of
   one step of tools/bench_trl.py's workload and two larger ones. Each pair runs alternately, median.
2. Share of step time: a real tiny GRPO run; its committed batches (read back from HDF5) are streamed
   through the transport, and the time of two hops per step (generator -> scorer -> trainer) is set
   against the run's mean step time.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgpack
import numpy as np
import zmq

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench_store import synthetic_batch  # noqa: E402
from toolkit.samples import SampleBatch  # noqa: E402
from toolkit.transport.sockets import Inbox, Outbox  # noqa: E402
from toolkit.transport.wire import Codec, new_secret  # noqa: E402

# (label, samples, response tokens (up to), prompt tokens); the first is bench_trl.py's step batch
SIZES = [("bench_trl step batch", 64, 128, 16), ("512 x 512 tokens", 512, 512, 128),
         ("1024 x 2048 tokens", 1024, 2048, 256)]
HWM = 8        # transport.max_inflight_messages' default
WARM = 3       # messages sent before the clock starts
TARGET_MB = 2000


def raw_frames(batch: SampleBatch) -> list:
    meta, arrays = batch.to_message()[1:]
    header = {"meta": meta, "arrays": [[name, a.dtype.name, list(a.shape)] for name, a in arrays.items()]}
    return [msgpack.packb(header, use_bin_type=True)] + [memoryview(np.ascontiguousarray(a).reshape(-1).view(np.uint8))
                                                         for a in arrays.values()]


def receiver(system: str, secret: bytes, count: int, conn) -> None:
    """Bind, tell the sender where, take WARM messages, say so, take `count` more; send the end time."""
    ctx = zmq.Context()
    if system == "slurm-rlhf":
        inbox = Inbox(ctx, Codec(secret, "trainer"), "127.0.0.1", HWM)
        conn.send(inbox.address)
        close = inbox.close

        def take() -> SampleBatch:
            msg = inbox.recv(120)
            if msg is None:
                raise TimeoutError("no message in 120 s")
            return SampleBatch.from_message(msg)
    else:
        sock = ctx.socket(zmq.PULL)
        sock.setsockopt(zmq.RCVHWM, HWM)
        conn.send(f"tcp://127.0.0.1:{sock.bind_to_random_port('tcp://127.0.0.1')}")
        close = sock.close

        def take() -> SampleBatch:
            frames = sock.recv_multipart(copy=False)
            header = msgpack.unpackb(frames[0].buffer, raw=False)
            arrays = {name: np.frombuffer(f.buffer, dtype).reshape(shape)
                      for (name, dtype, shape), f in zip(header["arrays"], frames[1:])}
            meta = {k: v for k, v in header["meta"].items() if k != "stage"}
            return SampleBatch.from_parts(meta, arrays)
    try:
        for _ in range(WARM):
            take()
        conn.send("warm")
        for _ in range(count):
            batch = take()
        conn.send((time.monotonic(), len(batch)))
    finally:  # (a timeout too: an open socket would hold term() forever)
        close()
        ctx.term()  # (not destroy(): the inbox's gate reads a socket of the context in a thread of its own)


def stream(system: str, batch: SampleBatch, count: int) -> float:
    """Seconds to stream `count` messages of `batch` from this process to a receiver process."""
    secret = new_secret()
    here, there = mp.Pipe()
    proc = mp.get_context("spawn").Process(target=receiver, args=(system, secret, count, there), daemon=True)
    proc.start()
    ctx = zmq.Context()
    try:
        address = here.recv()
        if system == "slurm-rlhf":
            outbox = Outbox(ctx, Codec(secret, "generator-0"), [address], HWM)

            def put() -> None:
                outbox.send(*batch.to_message())
        else:
            sock = ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.SNDHWM, HWM)
            sock.connect(address)

            def put() -> None:
                sock.send_multipart(raw_frames(batch), copy=False)
        for _ in range(WARM):
            put()
        if not here.poll(120) or here.recv() != "warm":
            raise RuntimeError("receiver did not start")
        started = time.monotonic()
        for _ in range(count):
            put()
        if not here.poll(600):
            raise TimeoutError("receiver did not finish")
        ended, samples = here.recv()
        assert samples == len(batch)
        return ended - started
    finally:
        ctx.destroy(linger=0)
        proc.join(30)
        if proc.is_alive():
            proc.kill()


def payload_mb(batch: SampleBatch) -> float:
    return sum(len(memoryview(f)) for f in raw_frames(batch)) / 2**20


def bench_pair(batch: SampleBatch, repeats: int) -> tuple[float, float, int]:
    """(median s per message ours, raw, messages per repeat)."""
    count = int(min(2000, max(10, TARGET_MB / payload_mb(batch))))
    ours, raw = [], []
    for _ in range(repeats):
        ours.append(stream("slurm-rlhf", batch, count) / count)
        raw.append(stream("raw pyzmq", batch, count) / count)
    return statistics.median(ours), statistics.median(raw), count


def bench_sizes(repeats: int) -> float:
    rng = np.random.default_rng(0)
    print("Rollout streaming between two processes over TCP (localhost): slurm-rlhf's Outbox/Inbox vs raw pyzmq")
    header = (f"{'payload':<22}{'MB/msg':>8}{'msgs':>6}{'ours ms/msg':>13}{'ours MB/s':>11}"
              f"{'raw ms/msg':>12}{'raw MB/s':>10}{'ratio':>7}")
    print(header + "\n" + "-" * len(header))
    ratios = []
    for label, samples, response_len, prompt_len in SIZES:
        # (full-length responses for bench_trl.py's batch, as it forces them)
        batch = synthetic_batch(samples, response_len, prompt_len, rng, full_length=label.startswith("bench_trl"))
        mb = payload_mb(batch)
        ours, raw, count = bench_pair(batch, repeats)
        ratios.append(raw / ours)
        print(f"{label:<22}{mb:>8.3f}{count:>6}{ours * 1e3:>13.3f}{mb / ours:>11.1f}{raw * 1e3:>12.3f}"
              f"{mb / raw:>10.1f}{raw / ours:>7.2f}")
    print(f"(median of {repeats}; ratio = our throughput / raw pyzmq's)\n")
    return min(ratios)


def bench_share(steps: int, repeats: int) -> None:
    from toolkit.store import experience

    (REPO / "runs").mkdir(exist_ok=True)  # (a fresh clone has none)
    with tempfile.TemporaryDirectory(dir=REPO / "runs") as tmp:
        run_dir = Path(tmp) / "run"
        cmd = [sys.executable, "-m", "toolkit", "run", str(REPO / "templates/examples/tiny-grpo.yaml"),
               "--run-dir", str(run_dir), "--set", f"run.steps={steps}"]
        subprocess.run(cmd, check=True, cwd=REPO, capture_output=True, text=True)
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][1:]
        batches = [experience.batch_of(experience.read(p))
                   for p in sorted((run_dir / "experience").glob("step-*.h5"))][1:]
    step_s = statistics.mean(r["step_s"] for r in records)
    per_message = statistics.mean(bench_pair(b, 1)[0] for b in batches[: max(1, min(3, len(batches)))])
    transport_s = 2 * per_message
    print(f"Share of step time in a tiny GRPO run ({steps} steps, first left out; 2 hops per step:"
          " generator -> scorer -> trainer, each the step's whole batch)")
    header = f"{'':<24}{'MB/step':>9}{'s/step':>9}{'step s':>9}{'share':>8}"
    print(header + "\n" + "-" * len(header))
    print(f"{'rollout streaming':<24}{2 * payload_mb(batches[0]):>9.3f}{transport_s:>9.4f}{step_s:>9.3f}"
          f"{transport_s / step_s:>8.2%}\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10, help="steps of the tiny run (0: skip it)")
    args = parser.parse_args()
    if args.steps == 1:
        parser.error("--steps: 2 or more (the first step is left out of the share), or 0 to skip the run")
    ratio = bench_sizes(args.repeats)
    if args.steps:
        bench_share(args.steps, args.repeats)
    print(f"ratio {ratio:.2f}  (our streaming throughput / raw pyzmq's, lowest over the payloads)")


if __name__ == "__main__":
    from toolkit.command import run_command

    sys.exit(run_command(main))
