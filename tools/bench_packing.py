"""SFT throughput with and without packing, on rows of very different lengths, side by side.

    python tools/bench_packing.py [--steps 30] [--rows 2000] [--model models/tiny/model]

Writes a JSON Lines file of prompt/response rows whose responses are 1 to 90 words long (the spread real
instruction data has), then runs the same `slurm-rlhf sft` twice: padded micro-batches (each padded to its
longest row), and packed (a micro-batch's rows in one sequence, attention kept per row). The figures are
medians over the steps after the first two (start-up): tokens trained per second, and the share of the
computed positions that were padding; the ratio (packed / padded) comes last. The loss of the first step
is shown for both: packing changes what is computed, not the result.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def rows(n: int, seed: int = 0) -> list[dict]:
    from toolkit.tiny import TEMPLATES, TOPICS, WORDS

    rng = random.Random(seed)
    return [{"prompt": rng.choice(TEMPLATES).format(t=rng.choice(TOPICS)),
             "response": " ".join(rng.choice(WORDS) for _ in range(max(1, int(rng.expovariate(1 / 20)) % 90)))}
            for _ in range(n)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rows", type=int, default=2000)
    parser.add_argument("--model", default=str(REPO / "models" / "tiny" / "model"))
    args = parser.parse_args()
    if args.steps < 3:
        parser.error("--steps: 3 or more (the first two steps are left out of the medians)")

    from toolkit.table import text_table

    out = [("mode", "tokens/s (median)", "padding", "step s (median)", "first loss")]
    figures = {}
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "rows.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in rows(args.rows)))
        for packing in (False, True):
            config = {"stage": "sft", "run": {"name": "bench", "steps": args.steps, "seed": 1},
                      "data": {"sources": [{"path": str(data)}]}, "model": {"base": args.model},
                      "train": {"batch_size": 32, "micro_batch_size": 16, "max_tokens": 160, "eval_every": 10**6,
                                "packing": packing},
                      "checkpoint": {"every_steps": 10**6}}
            path = Path(tmp) / f"sft-{packing}.yaml"
            path.write_text(yaml.safe_dump(config))
            run_dir = Path(tmp) / f"run-{packing}"
            done = subprocess.run([sys.executable, "-m", "toolkit", "sft", str(path), "--run-dir", str(run_dir)],
                                  capture_output=True, text=True, cwd=REPO)
            if done.returncode != 0:
                print(done.stdout[-2000:], done.stderr[-2000:], file=sys.stderr)
                return 1
            metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
            steady = metrics[2:]
            tps = statistics.median(m["tokens_per_s"] for m in steady)
            figures[packing] = tps
            out.append(("packed" if packing else "padded", f"{tps:.0f}",
                        f"{statistics.median(m['padding_frac'] for m in steady):.0%}",
                        f"{statistics.median(m['step_s'] for m in steady):.3f}", f"{metrics[0]['loss']:.4f}"))
    print(text_table(out))
    print(f"ratio {figures[True] / figures[False]:.2f} (packed tokens/s over padded)")
    return 0


if __name__ == "__main__":
    from toolkit.command import run_command

    sys.exit(run_command(main))
