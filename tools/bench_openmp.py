"""OpenMP's wait policy side by side: how a run's steps take a busy machine.

    python tools/bench_openmp.py [--steps 5] [--busy 1] [--keep DIR]

Runs the tiny GRPO run (templates/examples/tiny-grpo.yaml on models/tiny: a vLLM generator, a scorer and
a DeepSpeed trainer, each a process of its own on this machine) four times: with OMP_WAIT_POLICY=PASSIVE
(the default of every slurm-rlhf process, toolkit/launch/openmp.py) and =ACTIVE (threads that spin while
they wait; GNU OpenMP's own default spins too, up to 300,000 times before it sleeps), each alone and
beside `--busy` processes that only burn CPU (`while True: pass`), as another job or test on a shared
node would. Prints the median step time of each (the first step, with vLLM's warm-up, left out) and the
run's wall time, then the ratio of ACTIVE's median step to PASSIVE's, alone and beside the busy ones.

    python tools/bench_openmp.py --spin 3000,30000,300000 [--steps 5] [--busy 1]

`run.openmp_spin` side by side: tools/bench_trl.py's workload (its 26M Llama, 16 prompts x 4 samples x
128 new tokens, GRPO) in Flattening, every role in one worker process as on a node of its own, with
`run.openmp_spin` 0 (the default: threads sleep at once) and each count given (GOMP_SPINCOUNT; GNU
OpenMP's default without OMP_WAIT_POLICY is 300,000, what TRL and plain torch run with), alone and beside
`--busy` busy processes. Prints each run's median step and phases, then the ratio of the default's median
step to the fastest count's, alone and beside the busy ones.
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


def busy_processes(count: int) -> list[subprocess.Popen]:
    """`count` processes that only burn CPU (`while True: pass`). Each gets SIGTERM when this process ends, however
    it ends (Linux' PR_SET_PDEATHSIG): killed (a test's or a job's time limit, `kill`), this tool cannot kill them
    itself, and they spun on, a core each, until someone found them."""
    from toolkit.launch.forkserver import die_with_parent

    return [subprocess.Popen([sys.executable, "-c", "while True: pass"], preexec_fn=die_with_parent)
            for _ in range(count)]


def one_run(config: Path, run_dir: Path, policy: str, busy: int) -> tuple[float, float]:
    """(median step seconds, wall seconds) of the run with OMP_WAIT_POLICY=`policy`, beside `busy` hogs."""
    hogs = busy_processes(busy)
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


def spin_table(counts: list[int], steps: int, busy: int, keep: Path | None) -> None:
    """`run.openmp_spin` 0 and each of `counts` on bench_trl's workload in Flattening, alone and beside `busy`
    busy processes (the runs in `keep`, or in a temporary directory)."""
    from tools.bench_trl import build_model, ours
    from toolkit.table import text_table
    from toolkit.tiny import build_tiny

    rows, steps_s = [("run.openmp_spin", "beside", "step s (median)", "generate s", "score s", "train s")], {}
    with tempfile.TemporaryDirectory() as name:
        tmp = keep or Path(name)
        tmp.mkdir(parents=True, exist_ok=True)
        tiny = build_tiny(tmp / "tiny")
        build_model(tiny, tmp / "model")
        for beside in sorted({0, busy}):
            for count in (0, *counts):
                hogs = busy_processes(beside)
                try:
                    r = ours(tmp / "model", tiny / "prompts.jsonl", tmp, "flattening", steps,
                             run={"openmp_spin": count}, name=f"-spin{count}-{beside}")
                finally:
                    for hog in hogs:
                        hog.kill()
                        hog.wait()
                steps_s[count, beside] = r["step_s"]
                rows.append((str(count), f"{beside} busy", *(f"{r[k]:.2f}" for k in ("step_s", "generate_s", "score_s",
                                                                                      "train_s"))))
    print(f"GRPO step of tools/bench_trl.py's workload in Flattening (one worker), {steps} steps measured, "
          f"{os.cpu_count()} cores")
    print(text_table(rows))
    fastest = min(counts, key=lambda c: steps_s[c, 0])
    print(f"ratio run.openmp_spin 0 / {fastest} median step: alone {steps_s[0, 0] / steps_s[fastest, 0]:.2f}, "
          f"beside {busy} busy {steps_s[0, busy] / steps_s[fastest, busy]:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--busy", type=int, default=1, help="busy processes beside the run (default 1)")
    parser.add_argument("--keep", type=Path, help="write the runs here (default: a temporary directory)")
    parser.add_argument("--spin", help="spin counts to set run.openmp_spin to, e.g. 3000,30000: compare them "
                        "with 0 on tools/bench_trl.py's workload in Flattening instead")
    args = parser.parse_args()
    if args.steps < 2:
        parser.error("--steps: 2 or more (the first step is left out of the medians)")
    if args.spin:
        try:
            counts = [int(c) for c in args.spin.split(",")]
        except ValueError:
            parser.error(f"--spin: comma-separated whole numbers, not {args.spin!r}")
        if not counts or min(counts) < 1:
            parser.error("--spin: counts of 1 or more (0, the default, is always run)")
        return spin_table(counts, args.steps, args.busy, args.keep)
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
    from toolkit.command import run_command

    sys.exit(run_command(main))
