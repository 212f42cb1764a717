"""Samples sent on in parts as they finish (`rollout.stream_groups`) against all at once, side by side.

    python tools/bench_stream.py [--steps 5] [--groups 4]

The workload of `tools/bench_trl.py --variable`: its 26M-parameter Llama, whose samples end at
end-of-sequence with probability 1/64 a token (geometric lengths, mean about 64, cut at 256), 16 prompts
x 4 samples a step, synchronous Separation. Four real runs, one after the other: the generator and the
scorer on a core each (`cpus_per_worker: 1`, the trainer on both), then every worker on every core (the
default), each with `stream_groups` 0 (one message, once the last sample has finished) and `--groups`.
The figure is each run's median step time over the steps after the first (and before the last, which
exports); the last line is `ratio R`: with cores of their own, the step time all at once over in parts.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_trl import EOS_RATE, build_model, ours  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=5, help="measured steps of each run (after a first one)")
    parser.add_argument("--groups", type=int, default=4, help="rollout.stream_groups of the runs in parts")
    args = parser.parse_args()
    if args.steps < 1:
        parser.error(f"--steps {args.steps}: 1 or more (each run's first step, start-up, is not measured)")
    if args.groups < 1:
        parser.error(f"--groups {args.groups}: 1 or more (the runs in parts are set against one all at once)")
    from toolkit.table import text_table
    from toolkit.tiny import build_tiny

    own = {group: {"cpus_per_worker": 1} for group in ("generator", "scorer")}
    own["trainer"] = {"cpus_per_worker": 2}
    placements = (("generator and scorer on a core each", own), ("every worker on every core", {}))
    rows = [("placement", "stream_groups", "step s (median)", "generate s", "score s", "train s", "reward mean")]
    steps = {}
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        tiny = build_tiny(tmp / "tiny")
        model = tmp / "model"
        build_model(tiny, model, EOS_RATE)
        for label, placement in placements:
            for groups in (0, args.groups):
                r = ours(model, tiny / "prompts.jsonl", tmp, "separation", args.steps, variable=True,
                         rollout={"stream_groups": groups}, placement=placement, name=f"-{len(steps)}")
                steps[label, groups] = r["step_s"]
                rows.append((label, str(groups), f"{r['step_s']:.2f}", f"{r['generate_s']:.2f}", f"{r['score_s']:.2f}",
                             f"{r['train_s']:.2f}", f"{r['reward_mean']:.4f}"))
                print(f"{label}, stream_groups {groups}: {r['step_s']:.2f} s a step", file=sys.stderr)
    print(f"GRPO step, Separation, synchronous: 26M-parameter Llama, 16 prompts x 4 samples of geometric length "
          f"(end of sequence at 1/{round(1 / EOS_RATE)} a token), {args.steps} steps measured")
    print(text_table(rows))
    label = placements[0][0]
    print(f"ratio {steps[label, 0] / steps[label, args.groups]:.2f}  (step time all at once / in parts, {label})")
    return 0


if __name__ == "__main__":
    from toolkit.command import run_command

    sys.exit(run_command(main))
