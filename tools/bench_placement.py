"""Run the three placement strategies on the same workload; print the planner's predicted step time
beside the measured one.

    python tools/bench_placement.py [--cluster templates/clusters/this-machine.yaml] [--steps 8]
                                    [--strategies separation,flattening,interleaving] [--set rollout.max_policy_lag=1]

Each strategy is a real `slurm-rlhf run` (local launcher) of templates/examples/tiny-grpo.yaml; the
measured step time is the median `step_s` of its steps after the first two (start-up: lazy allocations,
first compilation of kernels). The prediction is `placement.cost.estimate` for the same config, with the
rates of the cluster file (write one for this machine with tools/calibrate.py). `--set` changes the
config of every run and of its prediction alike (e.g. asynchronous mode, `rollout.max_policy_lag=1`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
PHASES = (("generate", "generate_s"), ("score", "score_s"), ("train", "train_s"), ("sync", "sync_s"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cluster", default=str(REPO / "templates/clusters/this-machine.yaml"))
    parser.add_argument("--config", default=str(REPO / "templates/examples/tiny-grpo.yaml"))
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--strategies", default="separation,flattening,interleaving")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                        help="a config change for every run (repeatable)")
    args = parser.parse_args()
    if args.steps < 3:
        parser.error("--steps: 3 or more (the first two steps are left out of the medians)")

    from toolkit.config import load_config
    from toolkit.placement.cluster import load_cluster
    from toolkit.placement.cost import estimate
    from toolkit.placement.planner import setting_of, workload_of
    from toolkit.table import text_table

    cluster = load_cluster(args.cluster)
    rows = [("strategy", "engine", "predicted s", "measured s", "error", *(f"{p} pred/meas" for p, _ in PHASES))]
    worst = 0.0
    with tempfile.TemporaryDirectory() as tmp:
        for strategy in args.strategies.split(","):
            sets = [f"run.steps={args.steps}", f"placement.strategy={strategy}", "checkpoint.every_steps=1000",
                    *args.set]
            cfg = load_config(args.config, sets)
            run_dir = Path(tmp) / strategy
            cmd = [sys.executable, "-m", "toolkit", "run", args.config, "--run-dir", str(run_dir)]
            for s in sets:
                cmd += ["--set", s]
            result = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
            if result.returncode:
                print(result.stdout + result.stderr, file=sys.stderr)
                return 1
            records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][2:]
            measured = statistics.median(r["step_s"] for r in records)
            # Predict with the response length the run actually had (the model cannot know when EOS comes).
            response = statistics.mean(r["response_len_mean"] for r in records)
            e = estimate(setting_of(cfg), workload_of(cfg, response_tokens=response), cluster)
            error = e.step_s / measured - 1
            worst = max(worst, abs(error))
            phases = []
            for name, key in PHASES:
                phases.append(f"{e.phases[name]:.3f}/{statistics.median(r[key] for r in records):.3f}")
            rows.append((strategy, cfg.generation_backend, f"{e.step_s:.3f}", f"{measured:.3f}", f"{error:+.0%}",
                         *phases))
            print(f"{strategy}: done", file=sys.stderr)
    print(f"cluster file: {args.cluster} ({cluster.measured})")
    print(f"workload: {args.config}{''.join(f' --set {s}' for s in args.set)}, {args.steps} steps, "
          f"median of steps 3..{args.steps}")
    print(text_table(rows))
    print(f"largest error: {worst:.0%}")
    return 0


if __name__ == "__main__":
    from toolkit.command import run_command

    sys.exit(run_command(main))
