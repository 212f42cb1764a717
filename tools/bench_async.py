"""Synchronous against asynchronous mode (Separation) on the same workload, side by side.

    python tools/bench_async.py [--steps 40] [--cpus-per-worker 1]

Each mode is a real `slurm-rlhf run` (local launcher) of templates/examples/tiny-grpo.yaml with the
same seed: max_policy_lag 0 (synchronous), then asynchronous modes. The step time is the median
`step_s` after the first two steps (start-up); `speed-up` is the first row's median over the mode's.
Rewards show whether learning kept up: mean reward of the first and of the last 5 steps. Each worker
gets `--cpus-per-worker` threads (on a 2-core machine, two busy workers with 2 threads each fight for
the cores and overlap buys nothing); one synchronous row keeps the default threads, for comparison.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
# (name, max_policy_lag, stale, threads per worker: None = --cpus-per-worker, 0 = the default)
MODES = (("sync", 0, "wait", None), ("sync, default threads", 0, "wait", 0), ("async lag 1, wait", 1, "wait", None),
         ("async lag 2, wait", 2, "wait", None), ("async lag 1, drop", 1, "drop", None))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(REPO / "templates/examples/tiny-grpo.yaml"))
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--cpus-per-worker", type=int, default=1)
    args = parser.parse_args()
    if args.steps < 3:
        parser.error(f"--steps {args.steps}: 3 or more (the first two steps are left out of the medians)")
    if args.cpus_per_worker < 0:
        parser.error(f"--cpus-per-worker {args.cpus_per_worker}: 0 (the placement's default) or more")
    from toolkit.table import text_table

    rows = [("mode", "step s (median)", "speed-up", "run s", "lag mean", "dropped", "reward first 5", "last 5")]
    base = None
    with tempfile.TemporaryDirectory() as tmp:
        for name, lag, stale, threads in MODES:
            threads = args.cpus_per_worker if threads is None else threads
            sets = [f"run.steps={args.steps}", f"rollout.max_policy_lag={lag}", f"rollout.stale={stale}",
                    "checkpoint.every_steps=1000",
                    *(f"placement.{g}.cpus_per_worker={threads}" for g in ("generator", "scorer", "trainer") if threads)]
            run_dir = Path(tmp) / f"lag{lag}-{stale}-{threads}"
            cmd = [sys.executable, "-m", "toolkit", "run", args.config, "--run-dir", str(run_dir)]
            for s in sets:
                cmd += ["--set", s]
            started = time.monotonic()
            result = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
            if result.returncode:
                print(result.stdout + result.stderr, file=sys.stderr)
                return 1
            records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
            step_s = statistics.median(r["step_s"] for r in records[2:])
            run_s = sum(r["step_s"] for r in records)
            base = base or step_s
            rows.append((name, f"{step_s:.3f}", f"{base / step_s:.2f}x", f"{run_s:.1f}",
                         f"{statistics.mean(r['policy_lag_mean'] for r in records):.2f}",
                         str(sum(r["dropped_samples"] for r in records)),
                         f"{statistics.mean(r['reward_mean'] for r in records[:5]):.3f}",
                         f"{statistics.mean(r['reward_mean'] for r in records[-5:]):.3f}"))
            print(f"{name}: {time.monotonic() - started:.0f} s", file=sys.stderr)
    print(text_table(rows))
    return 0


if __name__ == "__main__":
    from toolkit.command import run_command

    sys.exit(run_command(main))
