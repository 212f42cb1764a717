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
