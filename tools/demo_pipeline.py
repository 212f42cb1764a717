"""The pipeline demo: DeepSpeed-Chat's three steps on the tiny model, and proof that it learns.

    .venv/bin/python tools/demo_pipeline.py [RUN_DIR] [--slurm]     (tools/demo_pipeline.sh installs first)

Builds the tiny model set and its synthetic task offline (`slurm-rlhf tiny models/tiny`: prompts whose
pairs hide a preference for digits, which no prompt asks for), then runs
templates/examples/tiny-pipeline.yaml: SFT on the sft part of the rows, a reward model on the rm part's
pairs, and GRPO on the rl part's prompts with that reward model (not the rule). Here, one stage after
the other, or with --slurm as three jobs on the local Slurm cluster chained with --dependency=afterok.
The hidden rule itself is a reward component of weight 0 (`true_reward`): measured, never trained on.
The last line prints the figures:
    pipeline: sft eval loss A -> B; rm held-out accuracy C; true reward sft D -> rl E
(D: the samples of the SFT model, the first RL step's; E: the mean of the last 5 steps.)
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def figures(run_dir: Path) -> str:
    sft = [r for r in metrics(run_dir / "sft" / "metrics.jsonl") if "eval_loss" in r]
    rm = [r for r in metrics(run_dir / "rm" / "metrics.jsonl") if "eval_accuracy" in r]
    rl = metrics(run_dir / "rl" / "metrics.jsonl")
    last = sum(r["reward/true_reward"] for r in rl[-5:]) / len(rl[-5:])
    return (f"pipeline: sft eval loss {sft[0]['eval_loss']:.3f} -> {sft[-1]['eval_loss']:.3f}; "
            f"rm held-out accuracy {rm[-1]['eval_accuracy']:.3f}; "
            f"true reward sft {rl[0]['reward/true_reward']:.3f} -> rl {last:.3f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", nargs="?", default="runs/demo-pipeline")
    parser.add_argument("--slurm", action="store_true", help="submit the stages to Slurm (bash slurm/up.sh 4 first)")
    args = parser.parse_args()
    cli = [sys.executable, "-m", "toolkit"]
    run_dir = Path(args.run_dir).resolve()
    subprocess.run([*cli, "tiny", str(REPO / "models" / "tiny")], check=True, cwd=REPO)
    if (run_dir / "pipeline.json").exists() and '"tiny-pipeline"' in (run_dir / "pipeline.json").read_text():
        print(f"demo: replacing the previous demo pipeline in {run_dir}", flush=True)
        shutil.rmtree(run_dir)
    started = time.monotonic()
    command = "submit" if args.slurm else "run"
    extra = ["--wait"] if args.slurm else []
    result = subprocess.run([*cli, command, str(REPO / "templates" / "examples" / "tiny-pipeline.yaml"),
                             "--run-dir", str(run_dir), *extra], cwd=REPO)
    if result.returncode != 0:
        return result.returncode
    print(f"demo: the pipeline took {time.monotonic() - started:.1f} s", flush=True)
    print(figures(run_dir), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
