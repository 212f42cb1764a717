"""The fault matrix: kill -9 and SIGSTOP of each role at a seeded step, each against an uninterrupted run.

    python tools/fault_matrix.py [--seed 2026] [--steps 6]

Every row is a real `slurm-rlhf run` (local launcher) of templates/examples/tiny-grpo.yaml, deterministic
(`run.deterministic`), checkpoint every 2 steps, heartbeats every 0.5 s and a 4 s heartbeat timeout. The
faulted process is the one that reaches the role's phase (generating, scoring, training) at the drawn
step, held there by the test hook (toolkit/hold.py) and then sent the signal. Columns: seconds from the
signal until the driver acts ("detected": a dead process at once, a stopped one after the heartbeat
timeout) and until the run goes on ("back"); the run's wall time and its cost over the uninterrupted
run; the largest difference of a step's mean reward and of an actor weight from the uninterrupted run;
sample groups lost and kept twice, read back from the committed HDF5 files.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
WHERE = {"generator": "generating", "scorer": "scoring", "trainer": "training"}
ACTED = ("starting it again alone", "starting every worker again")


def run(config: Path, run_dir: Path, steps: int, hold: str = "", how: signal.Signals | None = None) -> dict:
    """One run, faulted at `hold` with `how` if given: {wall_s, detected_s, back_s}."""
    from toolkit.hold import ENV, held_file

    sets = [f"run.steps={steps}", "run.seed=5", "run.deterministic=true", "checkpoint.every_steps=2",
            "transport.heartbeat_interval_s=0.5", "transport.heartbeat_timeout_s=4"]
    cmd = [sys.executable, "-m", "toolkit", "run", str(config), "--run-dir", str(run_dir)]
    for s in sets:
        cmd += ["--set", s]
    started = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env={**os.environ, ENV: hold})
    lines: list[tuple[float, str]] = []
    reader = threading.Thread(target=lambda: lines.extend((time.monotonic(), line) for line in proc.stdout))
    reader.start()
    signalled = None
    try:
        if how is not None:
            marker = held_file(run_dir, hold)
            while not marker.exists() or not marker.read_text().strip():
                if proc.poll() is not None or time.monotonic() - started > 600:
                    raise SystemExit(f"the run ended or stalled before {hold}")
                time.sleep(0.05)
            os.kill(int(marker.read_text()), how)
            signalled = time.monotonic()
        proc.wait(timeout=900)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        reader.join()
    wall = time.monotonic() - started
    if proc.returncode != 0:
        raise SystemExit(f"run {run_dir} failed:\n" + "".join(line for _, line in lines[-30:]))
    result = {"wall_s": wall, "detected_s": None, "back_s": None}
    if signalled is not None:
        acted = next((t for t, line in lines if any(a in line for a in ACTED)), None)
        after = [(t, line) for t, line in lines if acted is not None and t >= acted]
        back = next((t for t, line in after if "is back; the run goes on" in line or "all workers ready" in line), None)
        result["detected_s"] = acted - signalled if acted else None
        result["back_s"] = back - signalled if back else None
    return result


def compare(run_dir: Path, baseline: Path, steps: int) -> tuple[float, float, int, int]:
    """(largest |reward difference| of a step, largest |weight difference|, groups lost, groups twice)."""
    from safetensors.torch import load_file

    from toolkit.store import experience

    rewards = [[json.loads(line)["reward_mean"] for line in (d / "metrics.jsonl").read_text().splitlines()]
               for d in (run_dir, baseline)]
    reward_diff = max(abs(a - b) for a, b in zip(*rewards)) if len(rewards[0]) == len(rewards[1]) else float("inf")
    final = Path("checkpoints") / f"step-{steps:06d}" / "hf" / "model.safetensors"
    a, b = (load_file(d / final) for d in (run_dir, baseline))
    weight_diff = max((a[k] - b[k]).abs().max().item() for k in b)
    lost = twice = 0
    for step in range(steps):
        s = experience.read(run_dir / "experience" / experience.file_name(step))["samples"]
        base = experience.read(baseline / "experience" / experience.file_name(step))["samples"]
        pairs = list(zip(s["group_index"].tolist(), s["sample_index"].tolist()))
        expected = set(zip(base["group_index"].tolist(), base["sample_index"].tolist()))
        lost += len(expected - set(pairs))
        twice += len(pairs) - len(set(pairs))
    return reward_diff, weight_diff, lost, twice


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(REPO / "templates/examples/tiny-grpo.yaml"))
    parser.add_argument("--seed", type=int, default=2026, help="draws the step of each fault")
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()

    from toolkit.table import text_table
    from toolkit.tiny import build_tiny

    build_tiny(REPO / "models" / "tiny")
    rng = random.Random(args.seed)
    faults = [(role, how, rng.randint(1, args.steps)) for role in WHERE for how in (signal.SIGKILL, signal.SIGSTOP)]
    rows = [("fault", "at", "detected s", "back s", "run s", "extra s", "reward max |d|", "weight max |d|",
             "samples lost", "twice")]
    with tempfile.TemporaryDirectory(prefix="fault-matrix-") as tmp:
        baseline = Path(tmp) / "baseline"
        base = run(Path(args.config), baseline, args.steps)
        rows.append(("none", "-", "-", "-", f"{base['wall_s']:.1f}", "-", "-", "-", "-", "-"))
        print(f"uninterrupted: {base['wall_s']:.1f} s", flush=True)
        worst = [0.0, 0.0, 0, 0]
        for role, how, step in faults:
            moment = f"{WHERE[role]}@{step}"
            run_dir = Path(tmp) / f"{role}-{how.name}"
            got = run(Path(args.config), run_dir, args.steps, moment, how)
            diffs = compare(run_dir, baseline, args.steps)
            worst = [max(worst[0], diffs[0]), max(worst[1], diffs[1]), worst[2] + diffs[2], worst[3] + diffs[3]]
            fmt = lambda x: "-" if x is None else f"{x:.1f}"  # noqa: E731
            rows.append((f"{role} {how.name}", moment, fmt(got["detected_s"]), fmt(got["back_s"]),
                         f"{got['wall_s']:.1f}", f"{got['wall_s'] - base['wall_s']:+.1f}", f"{diffs[0]:.2g}",
                         f"{diffs[1]:.2g}", str(diffs[2]), str(diffs[3])))
            print(f"{role} {how.name} at {moment}: done in {got['wall_s']:.1f} s", flush=True)
    print()
    print(f"Fault matrix (seed {args.seed}; {args.steps}-step deterministic tiny GRPO run, local launcher)")
    print(text_table(rows))
    print(f"\nall {len(faults)} faulted runs: reward max |d| {worst[0]:.2g}, weight max |d| {worst[1]:.2g}, "
          f"{worst[2]} sample(s) lost, {worst[3]} kept twice")
    return 0 if worst[0] <= 1e-6 and worst[1] <= 1e-6 and worst[2] == worst[3] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
