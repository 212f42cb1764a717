"""Benchmark of durability costs: HDF5 experience commits and model checkpoints.

    .venv/bin/python tools/bench_store.py [--dir DIR] [--repeats N] [--steps N]

1. Commit throughput: an experience batch committed the way the trainer does it (HDF5 temp file, fsync,
   XXH3-128 checksum, rename, directory fsync), beside a plain sequential write of the same number of
   bytes with fsync, rename and directory fsync, in the same directory (same disk). Each writes a new
   file, as a commit does (replacing a file frees its blocks inside the clock). Sizes: the demo's batch
   and two larger ones.
2. Share of step time: a real tiny GRPO run (tiny-grpo.yaml, checkpoint every step) and, from its
   metrics, commit and checkpoint seconds against step seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from toolkit.config.base import CheckpointSection  # noqa: E402
from toolkit.samples import SampleBatch, ragged  # noqa: E402
from toolkit.store import experience  # noqa: E402

SIZES = [("demo batch", 64, 24, 9), ("512 x 512 tokens", 512, 512, 128), ("1024 x 2048 tokens", 1024, 2048, 256)]


def synthetic_batch(samples: int, response_len: int, prompt_len: int, rng: np.random.Generator,
                    full_length: bool = False) -> SampleBatch:
    """A scored batch of random tokens: responses of response_len/2..response_len tokens (all
    response_len with `full_length`), texts of 4 characters a token (also used by bench_transport.py)."""
    shortest = response_len if full_length else response_len // 2
    prompts = [rng.integers(3, 32000, prompt_len, dtype=np.int32) for _ in range(samples)]
    responses = [rng.integers(3, 32000, int(rng.integers(shortest, response_len + 1)), dtype=np.int32)
                 for _ in range(samples)]
    pt, po = ragged(prompts, np.int32)
    rt, ro = ragged(responses, np.int32)
    lp = -rng.random(len(rt), dtype=np.float32)
    return SampleBatch(step=0, prompt_ids=np.arange(samples, dtype=np.int64),
                       group_index=np.arange(samples, dtype=np.int32) // 8,
                       sample_index=np.arange(samples, dtype=np.int32) % 8,
                       policy_version=np.zeros(samples, np.int32), prompt_tokens=pt, prompt_offsets=po,
                       response_tokens=rt, response_offsets=ro, behaviour_logprobs=lp, finished=np.ones(samples, bool),
                       prompts=["x" * (prompt_len * 4)] * samples, responses=["y" * (response_len * 4)] * samples,
                       fields=[{}] * samples, ref_logprobs=lp - 0.01, rewards=rng.random((samples, 2), np.float32),
                       reward_names=["a", "b"], reward_weights=[1.0, 0.5])


def synthetic_record(samples: int, response_len: int, prompt_len: int, rng: np.random.Generator) -> dict:
    batch = synthetic_batch(samples, response_len, prompt_len, rng)
    tokens = len(batch.response_tokens)
    per_token = {k: rng.standard_normal(tokens, np.float32) for k in ("old_logprobs", "advantages", "values", "returns")}
    return experience.record_of(batch, per_token, "ppo", 0, 0.01, samples)


def plain_write(directory: Path, size: int, payload: bytes) -> float:
    tmp, final = directory / ".plain.tmp", directory / "plain.bin"
    started = time.perf_counter()
    with open(tmp, "wb") as f:
        f.write(payload[:size])
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, final)
    experience.fsync_dir(directory)
    return time.perf_counter() - started


def bench_commits(directory: Path, repeats: int) -> None:
    rng = np.random.default_rng(0)
    print("HDF5 experience commit vs plain sequential write + fsync of the same bytes (same directory)")
    header = f"{'batch':<20}{'file MB':>9}{'commit s':>10}{'commit MB/s':>13}{'plain s':>9}{'plain MB/s':>12}{'ratio':>7}"
    print(header + "\n" + "-" * len(header))
    ratios = []
    for label, samples, response_len, prompt_len in SIZES:
        record = synthetic_record(samples, response_len, prompt_len, rng)
        commit_s, plain_s, size = [], [], 0
        for i in range(repeats):
            started = time.perf_counter()
            path, _, size = experience.commit(directory, i, record)
            commit_s.append(time.perf_counter() - started)
            payload = os.urandom(size)
            plain_s.append(plain_write(directory, size, payload))
            path.unlink()  # (both files go outside the clock: each write makes a new file, none replaces one)
            (directory / "plain.bin").unlink()
        mb = size / 2**20
        c, p = statistics.median(commit_s), statistics.median(plain_s)
        print(f"{label:<20}{mb:>9.2f}{c:>10.4f}{mb / c:>13.1f}{p:>9.4f}{mb / p:>12.1f}{p / c:>7.2f}")
        if mb >= 1:
            ratios.append(p / c)
    print(f"(median of {repeats}; commit = HDF5 write + fsync + XXH3-128 checksum + rename + directory fsync;\n"
          " ratio = commit MB/s / plain MB/s)\n")
    return min(ratios)


def bench_run(directory: Path, steps: int, every: int) -> None:
    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        run_dir = Path(tmp) / "run"
        cmd = [sys.executable, "-m", "toolkit", "run", str(REPO / "templates/examples/tiny-grpo.yaml"),
               "--run-dir", str(run_dir), "--set", f"run.steps={steps}", "--set", "checkpoint.every_steps=1"]
        subprocess.run(cmd, check=True, cwd=REPO, capture_output=True, text=True)
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][1:]
    print(f"Share of step time in a tiny GRPO run ({steps} steps, checkpoint every step; first step left out)")
    step_s = statistics.mean(r["step_s"] for r in records)
    rows = [("experience commit", statistics.mean(r["commit_s"] for r in records)),
            ("model checkpoint", statistics.mean(r.get("checkpoint_s", 0.0) for r in records))]
    header = f"{'':<20}{'mean s':>9}{'step s':>9}{'share':>8}"
    print(header + "\n" + "-" * len(header))
    for label, seconds in rows:
        print(f"{label:<20}{seconds:>9.4f}{step_s:>9.3f}{seconds / step_s:>8.1%}")
    checkpoint_s = rows[1][1]
    print(f"{'checkpoint every ' + str(every):<20}{checkpoint_s / every:>9.4f}{step_s:>9.3f}"
          f"{checkpoint_s / every / step_s:>8.1%}   (checkpoint.every_steps default)")
    print(f"checkpoint size {statistics.mean(r.get('checkpoint_mb', 0.0) for r in records):.1f} MB "
          "(actor: DeepSpeed weights + optimizer state, HF copy)\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default=str(REPO / "runs" / "bench-store"),
                        help="where to write, the tiny run too (a disk to test)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10, help="steps of the tiny run (0: skip it)")
    args = parser.parse_args()
    if args.steps == 1:
        parser.error("--steps: 2 or more (the first step is left out of the share), or 0 to skip the run")
    directory = Path(args.dir).absolute()
    made = [d for d in (directory, *directory.parents) if not d.exists()]  # (removed again at the end)
    directory.mkdir(parents=True, exist_ok=True)
    try:
        ratio = bench_commits(directory, args.repeats)
        if args.steps:
            bench_run(directory, args.steps, CheckpointSection().every_steps)
    finally:
        for d in made:
            if not any(d.iterdir()):
                d.rmdir()
    print(f"ratio {ratio:.2f}  (HDF5 commit throughput / plain write + fsync, lowest over batches of 1 MB or more)")


if __name__ == "__main__":
    from toolkit.command import run_command

    sys.exit(run_command(main))
