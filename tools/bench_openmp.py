"""OpenMP's wait policy side by side: how a run's steps take a busy machine.

    python tools/bench_openmp.py [--steps 5] [--busy 1] [--keep DIR]

Runs the tiny GRPO run (templates/examples/tiny-grpo.yaml on models/tiny: a vLLM generator, a scorer and
a DeepSpeed trainer, each a process of its own on this machine) four times: with OMP_WAIT_POLICY=PASSIVE
(the default of every slurm-rlhf process, toolkit/launch/openmp.py) and =ACTIVE (threads that spin while
they wait; GNU OpenMP's own default spins too, up to 300,000 times before it sleeps), each alone and
beside `--busy` processes that only burn CPU (`while True: pass`), as another job or test on a shared
node would. Prints the median step time of each (the first step, with vLLM's warm-up, left out) and the
run's wall time, then the ratio of ACTIVE's median step to PASSIVE's, alone and beside the busy ones.
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

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def one_run(config: Path, run_dir: Path, policy: str, busy: int) -> tuple[float, float]:
    """(median step seconds, wall seconds) of the run with OMP_WAIT_POLICY=`policy`, beside `busy` hogs."""
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(busy)]
    try:
        started = time.monotonic()
        done = subprocess.run([sys.executable, "-m", "toolkit", "run", str(config), "--run-dir", str(run_dir)],
                              env={**os.environ, "OMP_WAIT_POLICY": policy}, capture_output=True, text=True,
                              timeout=1800)
        wall = time.monotonic() - started
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    if done.returncode != 0:
        raise SystemExit(f"the run with OMP_WAIT_POLICY={policy} failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    steps = [json.loads(line)["step_s"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return statistics.median(steps[1:]), wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--busy", type=int, default=1, help="busy processes beside the run (default 1)")
    parser.add_argument("--keep", type=Path, help="write the runs here (default: a temporary directory)")
    args = parser.parse_args()
    if args.steps < 2:
        parser.error("--steps: 2 or more (the first step is left out of the medians)")
    from tests.conftest import example, write_config
    from toolkit.tiny import build_tiny

    tiny = build_tiny(REPO / "models" / "tiny")
    with tempfile.TemporaryDirectory() as tmp:
        out = args.keep or Path(tmp)
        config = write_config(out, example("tiny-grpo.yaml", tiny, run={"steps": args.steps, "name": "openmp"}))
        rows = {}
        print(f"{'OMP_WAIT_POLICY':<16} {'beside':<10} {'median step s':>14} {'wall s':>8}")
        for busy in (0, args.busy):
            for policy in ("PASSIVE", "ACTIVE"):
                step, wall = one_run(config, out / f"{policy.lower()}-{busy}", policy, busy)
                rows[policy, busy] = step
                print(f"{policy:<16} {f'{busy} busy':<10} {step:>14.3f} {wall:>8.1f}", flush=True)
        print(f"ratio ACTIVE/PASSIVE median step: alone {rows['ACTIVE', 0] / rows['PASSIVE', 0]:.2f}, "
              f"beside {args.busy} busy {rows['ACTIVE', args.busy] / rows['PASSIVE', args.busy]:.2f}")


if __name__ == "__main__":
    main()
