"""The report's figures say what they draw: reward components as scored (before their weights), the
evaluations of the run and of `slurm-rlhf eval` alike, and steps and policy versions in whole numbers."""

from __future__ import annotations

from toolkit.report import plots


def whole_ticks(fig) -> list[list[float]]:
    """The x ticks inside each axes' view, once drawn."""
    fig.canvas.draw()
    return [[t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]] for ax in fig.axes]


def test_figures_label_components_unweighted_and_count_steps_in_whole_numbers():
    """The reward panel drew a weighted total beside components before their weights, both as 'reward';
    the evaluation figure said '(slurm-rlhf eval)' of the run's own in-run line too; 3 steps got ticks at
    0.5, 1.0, 1.5, ... and 2 evaluated policy versions at 1.0, 1.2, 1.4, ..."""
    metrics = [{"step": s, "reward_mean": 0.1 * s, "reward/digit_ratio": 0.2 * s, "kl": 0.01, "response_len_mean": 20,
                "generate_s": 1.0, "step_s": 1.5} for s in range(3)]
    curves = plots.curves(metrics)
    assert [line.get_label() for line in curves.axes[0].lines] == ["reward (total)", "reward digit_ratio (unweighted)"]
    evaluations = plots.evaluations({"heldout": [{"step": 1, "reward_mean": 0.2}, {"step": 2, "reward_mean": 0.4}],
                                     "in-run": [{"step": 1, "reward_mean": 0.3}, {"step": 2, "reward_mean": 0.5}]})
    ax = evaluations.axes[0]
    assert [line.get_label() for line in ax.lines] == ["heldout (slurm-rlhf eval): mean",
                                                       "in-run (the run's own): mean"]
    assert ax.get_title() == "reward on evaluation prompts at each checkpoint"
    for fig in (curves, plots.step_time(metrics), evaluations):
        for ticks in whole_ticks(fig):
            assert ticks and all(float(t).is_integer() for t in ticks), ticks


def drawn(fig) -> dict[str, list[tuple[str, float, float]]]:
    """{worker: [(phase, from, to)]} of a timeline figure's bars, read back by their colours."""
    from matplotlib.colors import to_hex

    ax = fig.axes[0]
    workers = [t.get_text() for t in ax.get_yticklabels()]
    phase_of = {to_hex(c): p for p, c in plots.COLORS.items()}
    out = {w: [] for w in workers}
    for bars in ax.collections:
        (x0, y0), (x1, _) = bars.get_paths()[0].vertices.min(0), bars.get_paths()[0].vertices.max(0)
        out[workers[round(y0 + 0.35)]].append((phase_of[to_hex(bars.get_facecolor()[0])], x0, x1))
    return {w: sorted(bars, key=lambda b: b[1]) for w, bars in out.items()}


def test_the_timeline_of_a_run_killed_and_resumed_draws_it_down_between_its_attempts():
    """The whole run killed (its driver, SIGKILL) in step 1 and resumed 100 s later: each worker's last phase
    was drawn until its new process registered, the generator `syncing` for the 97.5 s nothing ran. It ends
    at the last phase change of any worker (2.5 s); from then until the worker registers it is drawn down
    (`restarting`, as a worker started again alone is)."""
    def rows(*changes):
        return [{"t": t, "phase": phase, "step": step} for t, phase, step in changes]

    timelines = {"generator-0": rows((0.0, "registering", None), (0.1, "setup", None), (1.0, "generating", 0),
                                     (2.0, "syncing", 0), (100.0, "registering", None), (100.1, "setup", None),
                                     (101.0, "generating", 1)),
                 "trainer-0": rows((0.0, "registering", None), (0.1, "setup", None), (1.5, "training", 0),
                                   (2.0, "syncing", 0), (2.5, "idle", 0), (100.05, "registering", None),
                                   (100.1, "setup", None), (102.0, "training", 1))}
    bars = drawn(plots.timeline(timelines, 0.0, 103.0))
    for worker, phases in (("generator-0", ["syncing", "restarting", "registering"]),
                           ("trainer-0", ["restarting", "registering"])):
        later = [b for b in bars[worker] if b[0] in phases and 2.0 <= b[1] < 100.1]
        assert [p for p, *_ in later] == phases, bars[worker]
    (_, s0, s1), (_, d0, d1) = [b for b in bars["generator-0"] if b[0] in ("syncing", "restarting")]
    assert abs(s0 - 2.0) < 1e-9 and abs(s1 - 2.5) < 1e-9 and abs(d0 - 2.5) < 1e-9 and abs(d1 - 100.0) < 1e-9
    (_, t0, t1), = [b for b in bars["trainer-0"] if b[0] == "restarting"]
    assert abs(t0 - 2.5) < 1e-9 and abs(t1 - 100.05) < 1e-9


def test_a_figure_stopped_while_it_is_written_leaves_the_last_one_whole(tmp_path, monkeypatch):
    """`report` stopped while it wrote a PNG (Ctrl-C, a full disk) left a cut file where the last report's
    whole one was. The figure now goes to a file beside it and takes its place whole; stopped, nothing moves."""
    import pytest
    from matplotlib.figure import Figure

    metrics = [{"step": s, "reward_mean": 0.1 * s, "step_s": 1.0} for s in range(3)]
    path = tmp_path / "curves.png"
    plots.save(plots.curves(metrics), path)
    whole = path.read_bytes()
    assert whole.startswith(b"\x89PNG") and [p.name for p in tmp_path.iterdir()] == ["curves.png"]

    def cut_short(fig, target, **kwargs):
        with open(target, "wb") as f:
            f.write(whole[:100])
        raise KeyboardInterrupt

    monkeypatch.setattr(Figure, "savefig", cut_short)
    with pytest.raises(KeyboardInterrupt):
        plots.save(plots.curves(metrics), path)
    assert path.read_bytes() == whole and [p.name for p in tmp_path.iterdir()] == ["curves.png"]


def test_parking_is_drawn_as_a_phase_of_its_own():
    """`placement.offload`'s parking (the trainer's state to host memory while a generator in its worker runs,
    1.3-1.7 s of a Flattening step on this machine) was left out of the step-time bars, and its timeline phase
    was `idle`: drawn as a wait."""
    metrics = [{"step": 0, "generate_s": 0.3, "train_s": 0.2, "park_s": 1.3, "step_s": 2.0}]
    fig = plots.step_time(metrics)
    labels = fig.axes[0].get_legend_handles_labels()[1]
    assert labels == ["step (wall)", "generate", "train", "parking (placement.offload)"]
    phases = [{"t": t, "phase": phase, "step": 0} for t, phase in
              ((0.0, "registering"), (0.1, "generating"), (0.5, "training"), (0.7, "parking"), (2.0, "idle"))]
    bars = drawn(plots.timeline({"all-0": phases}, 0.0, 2.5))["all-0"]
    assert [p for p, *_ in bars] == ["registering", "generating", "training", "parking"], bars
    _, p0, p1 = bars[-1]
    assert abs(p0 - 0.7) < 1e-9 and abs(p1 - 2.0) < 1e-9


def test_the_step_time_of_a_long_run_is_drawn_in_seconds_as_bands(tmp_path):
    """A bar per step and phase: the report of a 1,000-step run spent 13 s on this figure, of 10,000 steps 176 s
    (60,000 bars, and the legend's search for a place among them). Past MAX_BARS steps each phase is one band,
    stacked as the bars were."""
    import time

    n = 3000
    metrics = [{"step": s, "generate_s": 0.1 + s / n, "score_s": 0.05, "train_s": 0.2, "sync_s": 0.01,
                "checkpoint_s": 0.3 * (s % 10 == 9), "step_s": 1.0} for s in range(n)]
    started = time.monotonic()
    fig = plots.step_time(metrics)
    plots.save(fig, tmp_path / "step_time.png")
    took_s = time.monotonic() - started
    ax = fig.axes[0]
    assert len(ax.patches) == 0 and len(ax.collections) == 5, (len(ax.patches), len(ax.collections))
    assert ax.get_legend_handles_labels()[1] == ["generate", "score", "train", "weight sync", "checkpoint",
                                                 "step (wall)"]
    def drawn_at(x, y):
        return any(band.get_paths()[0].contains_point((x, y)) for band in ax.collections)

    for s in (0, 1234, 2998, 2999):  # (the bands' upper edge is the sum of every phase)
        total = 0.1 + s / n + 0.05 + 0.2 + 0.01 + 0.3 * (s % 10 == 9)
        assert drawn_at(s + 1, total - 1e-3) and not drawn_at(s + 1, total + 1e-3), s
    assert took_s < 10, took_s
    assert (tmp_path / "step_time.png").stat().st_size > 0
