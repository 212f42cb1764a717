"""The report's figures (matplotlib, no display needed). Each function takes what the run wrote and
returns a Figure, or None when the run has nothing to draw for it."""

from __future__ import annotations

import bisect
import os
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

# What a step's seconds are spent on, as the driver records them (RL); a supervised stage has its update's
# step_s, and evaluation and checkpoint seconds.
PHASES = [("generate_s", "generate"), ("score_s", "score"), ("train_s", "train"), ("sync_s", "weight sync"),
          ("checkpoint_s", "checkpoint"), ("park_s", "parking (placement.offload)"), ("commit_s", "HDF5 commit"),
          ("eval_wall_s", "in-run evaluation"),
          ("eval_s", "evaluation")]  # (eval_s: a stage's evaluation, after its update, step_s)
COLORS = {"generating": "tab:blue", "scoring": "tab:orange", "training": "tab:green", "syncing": "tab:red",
          "checkpointing": "tab:purple", "collecting": "tab:olive", "replaying": "tab:brown",
          "evaluating": "tab:cyan", "setup": "tab:gray", "registering": "lightgray", "ready": "gainsboro",
          "parking": "tab:pink",  # (placement.offload: the trainer's state goes to host memory)
          "restarting": "black"}  # (restarting: the worker was lost; from then until it registers again; unseen_ends)
IDLE = ("idle", "done", "ready", "collecting")  # drawn as gaps: the worker waits (the trainer for samples)
MAX_BARS = 200  # steps drawn as bars in the step-time figure; more are drawn as bands (a bar is under 4 px wide)


def curves(metrics: list[dict]):
    """Reward (total and each component, as it scored: before its weight and the clip of the total), KL and
    response length for RL; losses and accuracy for a stage; against the steps trained (the progress line's
    step number, metrics.jsonl's `step` + 1)."""
    steps = [m["step"] + 1 for m in metrics]
    panels = []
    if any("reward_mean" in m for m in metrics):
        series = {"reward (total)": "reward_mean"}
        series.update({f"reward {k.split('/', 1)[1]} (unweighted)": k for k in sorted({k for m in metrics for k in m})
                       if k.startswith("reward/")})
        panels += [("reward", series), ("KL to the reference", {"kl": "kl"}),
                   ("response length (tokens)", {"mean": "response_len_mean"})]
    else:
        panels.append(("loss", {"train": "loss", "eval": "eval_loss"}))
        if any("accuracy" in m for m in metrics):
            panels.append(("preference accuracy", {"train": "accuracy", "eval": "eval_accuracy"}))
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.4), squeeze=False)
    for ax, (title, series) in zip(axes[0], panels):
        for label, key in series.items():
            points = [(m["step"] + 1, m[key]) for m in metrics if key in m]
            if points:
                ax.plot(*zip(*points), marker="." if len(points) < 40 else None, label=label)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlim(min(steps) - 0.5, max(steps) + 0.5)
        if len(series) > 1:
            ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def step_time(metrics: list[dict]):
    """Each step's seconds stacked by phase (a step trained again on a resume generated nothing)."""
    phases = [(key, label) for key, label in PHASES if any(key in m for m in metrics)]
    fig, ax = plt.subplots(figsize=(10, 3.4))
    steps = [m["step"] + 1 for m in metrics]
    if phases:
        bottom = [0.0] * len(metrics)
        for key, label in phases:
            values = [m.get(key, 0.0) for m in metrics]
            top = [b + v for b, v in zip(bottom, values)]
            if len(metrics) <= MAX_BARS:
                ax.bar(steps, values, bottom=bottom, label=label, width=0.85)
            else:  # (one band per phase: a bar per step and phase took 13 s at 1,000 steps, 176 s at 10,000)
                ax.fill_between(steps, bottom, top, step="mid", label=label, linewidth=0)
            bottom = top
    if any("step_s" in m for m in metrics):
        points = [(m["step"] + 1, m["step_s"]) for m in metrics if "step_s" in m]
        ax.plot(*zip(*points), color="black", marker="." if len(points) <= MAX_BARS else None, linewidth=1,
                label="step (wall)")
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("seconds")
    ax.set_title("step time by phase" + (" (phases of different workers overlap)" if phases else ""))
    ax.legend(fontsize=8, ncol=4)
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    return fig


def evaluations(summaries: dict[str, list[dict]]):
    """The mean reward (and best of n, where sampled) at each evaluated checkpoint, one line per set of prompts
    (RUN_DIR/eval/<name>/summary.jsonl: `slurm-rlhf eval`'s, and in-run, the run's own), at the checkpoint's
    policy version."""
    from toolkit.use.evaluate import IN_RUN

    if not any(summaries.values()):
        return None
    fig, ax = plt.subplots(figsize=(10, 3.4))
    for name, records in summaries.items():
        what = f"{name} (the run's own)" if name == IN_RUN else f"{name} (slurm-rlhf eval)"
        points = [(r["step"], r["reward_mean"]) for r in records]
        if not points:
            continue
        line, = ax.plot(*zip(*points), marker=".", label=f"{what}: mean")
        best = [(r["step"], r["reward_best_of_n_mean"]) for r in records if "reward_best_of_n_mean" in r]
        if best:
            ax.plot(*zip(*best), marker="^", linestyle=":", color=line.get_color(), label=f"{what}: best of n")
    ax.set_xlabel("checkpoint (policy version)")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_title("reward on evaluation prompts at each checkpoint")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def intervals(rows: list[dict], start: float, end: float) -> list[tuple[str, float, float]]:
    """(phase, from, to) of a worker's phase changes, clipped to [start, end]; waiting phases left out."""
    out = []
    for row, after in zip(rows, rows[1:] + [None]):
        t0, t1 = row["t"], after["t"] if after else end
        if t1 <= start or t0 >= end or row["phase"] in IDLE:
            continue
        out.append((row["phase"], max(t0, start), min(t1, end)))
    return out


def unseen_ends(timelines: dict[str, list[dict]]) -> dict[str, list[dict]]:
    """The timelines with a `restarting` row where a worker's process ended without one: the whole run was
    stopped unseen (its driver killed, a lost node) and resumed later. The phase a worker was in then was
    drawn until its new process registered, as if it had gone on all the while (a generator `syncing` for
    the half hour the run was down); it ends at the last phase change any worker made before the resumed
    attempt's first registration."""
    starts = sorted(r["t"] for rows in timelines.values() for before, r in zip([None] + rows, rows)
                    if r["phase"] == "registering" and (before is None or before["phase"] != "restarting"))
    times = sorted(r["t"] for rows in timelines.values() for r in rows)
    out = {}
    for worker, rows in timelines.items():
        marked = []
        for row, after in zip(rows, rows[1:] + [None]):
            marked.append(row)
            if after is not None and after["phase"] == "registering" and row["phase"] not in ("restarting", "done"):
                i = bisect.bisect_right(starts, row["t"])
                first = min(starts[i], after["t"]) if i < len(starts) else after["t"]
                j = bisect.bisect_left(times, first)  # (the stopped attempt's last sign of life: the change before)
                last = max(times[j - 1] if j else row["t"], row["t"])
                marked.append({"t": min(last, after["t"]), "phase": "restarting", "step": None})
        out[worker] = marked
    return out


def timeline(timelines: dict[str, list[dict]], start: float, end: float):
    """Every worker's phases between `start` and `end` (unix times): who works while whom waits."""
    timelines = unseen_ends(timelines)
    workers = [w for w, rows in timelines.items() if intervals(rows, start, end)]
    if not workers:
        return None
    fig, ax = plt.subplots(figsize=(10, 0.55 * len(workers) + 1.3))
    seen = {}
    for y, worker in enumerate(workers):
        for phase, t0, t1 in intervals(timelines[worker], start, end):
            bar = ax.broken_barh([(t0 - start, t1 - t0)], (y - 0.35, 0.7), color=COLORS.get(phase, "black"))
            seen.setdefault(phase, bar)
    ax.set_yticks(range(len(workers)), workers)
    ax.invert_yaxis()
    ax.set_xlim(0, end - start)
    ax.set_xlabel("seconds (white: waiting)")
    ax.set_title("what every worker does over the last steps")
    ax.legend(seen.values(), seen.keys(), fontsize=8, ncol=len(seen), loc="upper center",
              bbox_to_anchor=(0.5, -0.35 if len(workers) < 4 else -0.15))
    ax.grid(alpha=0.3, axis="x")
    fig.tight_layout()
    return fig


def save(fig, path) -> None:
    """Write `fig` as PNG `path` whole or not at all: a report stopped while it drew (Ctrl-C, a full disk) left
    a cut PNG in place of the last report's whole one."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        fig.savefig(tmp, dpi=100, format="png")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
        plt.close(fig)
