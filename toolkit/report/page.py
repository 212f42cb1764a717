"""The report page: reads a run directory (metrics.jsonl, timeline/, experience/, config.yaml,
status.json, and eval/ where `slurm-rlhf eval` wrote), draws the figures and writes REPORT_DIR/index.html
with every figure embedded (one file to copy or mail) and each figure as a PNG beside it. Nothing of the
run is changed."""

from __future__ import annotations

import base64
import html
import os
from pathlib import Path

from toolkit.errors import ConfigError

SAMPLES_SHOWN = 2  # the best and the worst this many samples of each chosen step
MARKER = ".slurm-rlhf-report"
"""In a folder report wrote: it writes there again; a folder with other files and no marker is refused
(unless --force), since its index.html and PNGs would be replaced."""

STYLE = """body{font-family:sans-serif;max-width:1100px;margin:1em auto;color:#222}
img{max-width:100%}pre{background:#f6f6f6;padding:.6em;overflow-x:auto;font-size:85%}
table{border-collapse:collapse;font-size:90%}td,th{border:1px solid #ccc;padding:.25em .5em;vertical-align:top}
td.text{white-space:pre-wrap;font-family:monospace;max-width:420px}h2{border-bottom:1px solid #ddd}"""


def _metrics(run_dir: Path) -> list[dict]:
    from toolkit.store.manifest import read_jsonl

    by_step = {m["step"]: m for m in read_jsonl(run_dir / "metrics.jsonl")}  # (a step written again on a resume: its last record)
    return [by_step[s] for s in sorted(by_step)]


def _experience_steps(run_dir: Path) -> list[int]:
    from toolkit.store.manifest import Manifest, held_experience

    return list(held_experience(run_dir, Manifest(run_dir).records()))


def _samples_section(run_dir: Path, steps: list[int]) -> str:
    from toolkit.data.prompts import prompt_text
    from toolkit.store import experience

    parts = []
    for step in steps:
        path = run_dir / "experience" / experience.file_name(step)
        try:
            record = experience.read(path)
        except (OSError, ValueError, KeyError) as e:  # (damaged since its commit: a resume would set it aside)
            parts.append(f"<h3>step {step + 1}</h3><p>{html.escape(str(path))} cannot be read ({html.escape(str(e))}); "
                         "<code>slurm-rlhf resume</code> checks every committed file and sets a damaged one aside.</p>")
            continue
        meta, samples = record["meta"], record["samples"]
        total = samples["reward_total"]
        order = sorted(range(len(total)), key=lambda i: -float(total[i]))
        chosen = order if len(order) <= 2 * SAMPLES_SHOWN else order[:SAMPLES_SHOWN] + order[-SAMPLES_SHOWN:]
        names = meta.get("reward_names", [])
        rows = ["<tr><th>sample</th><th>prompt</th><th>response</th><th>reward</th>"
                + "".join(f"<th>{html.escape(n)}</th>" for n in names) + "</tr>"]
        for i in chosen:
            components = "".join(f"<td>{float(v):.4f}</td>" for v in samples["rewards"][i])
            rows.append(f"<tr><td>{i}</td><td class=text>{html.escape(prompt_text(meta['prompts'][i]))}</td>"
                        f"<td class=text>{html.escape(meta['responses'][i])}</td><td>{float(total[i]):.4f}</td>"
                        f"{components}</tr>")
        mean = float(total.mean())
        parts.append(f"<h3>step {step + 1} (mean reward {mean:.4f} over {len(total)} samples; the best and the worst "
                     f"{SAMPLES_SHOWN})</h3><table>{''.join(rows)}</table>")
    return "".join(parts) or "<p>No committed experience.</p>"


def _evaluations(run_dir: Path) -> dict[str, list[dict]]:
    """{name: summary lines} of what `slurm-rlhf eval` wrote for the run (RUN_DIR/eval/<name>/summary.jsonl)."""
    from toolkit.store.manifest import read_jsonl

    return {path.parent.name: read_jsonl(path) for path in sorted((run_dir / "eval").glob("*/summary.jsonl"))}


def _evaluation_section(summaries: dict[str, list[dict]], target: Path) -> str:
    """The evaluation figure and a table of every checkpoint's figures, or a line saying how to get them."""
    from toolkit.report import plots

    figure = _figure("evaluation", plots.evaluations(summaries), target, "reward on evaluation prompts")
    if not any(summaries.values()):
        return "<p>None yet: <code>slurm-rlhf eval RUN_DIR</code> scores the checkpoints on held-out prompts.</p>"
    rows = ["<tr><th>prompts</th><th>checkpoint</th><th>reward</th><th>best of n</th><th>response length</th>"
            "<th>finished</th><th>samples</th><th>temperature</th></tr>"]
    for name, records in summaries.items():
        for r in records:
            best = f"{r['reward_best_of_n_mean']:.4f}" if "reward_best_of_n_mean" in r else ""
            rows.append(f"<tr><td>{html.escape(name)}</td><td>{r['step']}</td><td>{r['reward_mean']:.4f}</td>"
                        f"<td>{best}</td><td>{r['response_len_mean']:.1f}</td><td>{r['finished_frac']:.2f}</td>"
                        f"<td>{r['samples']}</td><td>{r['temperature']:g}</td></tr>")
    return f"{figure}<table>{''.join(rows)}</table>"


def _placement(run_dir: Path) -> str:
    try:
        from toolkit.config import load_config
        from toolkit.launch.allocation import placement_table, plan_allocation
        from toolkit.placement.plan import plan

        cfg = load_config(run_dir / "config.yaml")
        groups = plan(cfg)
        return f"{cfg.summary}\n\n{placement_table(groups, plan_allocation(groups, cfg.slurm.heterogeneous))}"
    except Exception as e:  # (e.g. a file the config names is gone: the report still shows the rest)
        return f"(the placement could not be drawn: {e})"


def _figure(name: str, fig, out: Path, alt: str) -> str:
    from toolkit.report.plots import save

    if fig is None:  # (a previous report's figure goes: the page no longer shows it)
        (out / f"{name}.png").unlink(missing_ok=True)
        return f"<p>{html.escape(alt)}: nothing to draw.</p>"
    save(fig, out / f"{name}.png")
    data = base64.b64encode((out / f"{name}.png").read_bytes()).decode()
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{data}">'


def write_report(run_dir: str, out: str | None = None, samples_at: list[int] | None = None,
                 last_steps: int = 4, force: bool = False) -> Path:
    """Write the report of `run_dir` into `out` (default RUN_DIR/report, the report's own); the page's path.
    `force`: also into a folder that holds other files and that report did not write (no MARKER)."""
    from toolkit.launch.jobs import open_run, state_text
    from toolkit.launch.pipeline import refuse_pipeline_dir
    from toolkit.launch.rundir import RunDir
    from toolkit.report import plots
    from toolkit.timeline import read_timelines

    run = Path(run_dir)
    refuse_pipeline_dir(run, "report")
    open_run(run)
    status = RunDir(run).read_json(run / "status.json")  # (a damaged one named before anything is written)
    metrics = _metrics(run)
    if not metrics:
        raise ConfigError(f"{run_dir}: no step has finished yet (metrics.jsonl is empty); nothing to report")
    target = Path(out) if out else run / "report"
    if target.exists() and not target.is_dir():
        raise ConfigError(f"--out {target} is a file; give a directory to write the report into")
    theirs = out is not None and target.is_dir() and not (target / MARKER).exists() and any(target.iterdir())
    if theirs and not force:
        raise ConfigError(f"--out {target} holds files that report did not write (no {MARKER} in it), and its "
                          "index.html and PNGs would be replaced; give a new or empty folder, or --force to write "
                          "there anyway")
    if not target.exists():
        target.mkdir(parents=True)
        os.chmod(target, 0o700)  # (samples and config: for the run's owner, as the run directory is)
    (target / MARKER).write_text(f"written by `slurm-rlhf report {run.resolve()}`, which writes this folder again\n")

    committed = _experience_steps(run)  # (from 0, as the experience files are named; samples_at from 1)
    if samples_at is None:
        samples_at = sorted({committed[0], committed[len(committed) // 2], committed[-1]}) if committed else []
    else:
        missing = [s for s in samples_at if s - 1 not in committed]
        if missing:
            raise ConfigError(f"--samples-at {','.join(map(str, missing))}: no committed experience of that step; "
                              f"this run has steps {committed[0] + 1}..{committed[-1] + 1} (numbered as the "
                              "progress line numbers them)" if committed else
                              "--samples-at: this run has no committed experience")
        samples_at = [s - 1 for s in samples_at]

    window = metrics[-(last_steps + 1):]
    timelines = read_timelines(run)
    first_t = min((rows[0]["t"] for rows in timelines.values() if rows), default=window[0]["time"])
    start = window[0]["time"] if len(window) > last_steps else first_t
    last = metrics[-1]
    facts = [("run", str(run.resolve())), ("state", state_text(RunDir(run), status)),
             ("steps", f"{last['step'] + 1} of {status.get('steps') or '?'}"),
             ("time", f"{(last['time'] - first_t) / 60:.1f} min from the first worker's start to the last step")]
    if "reward_mean" in last:
        facts.append(("reward", f"{metrics[0]['reward_mean']:.4f} (step {metrics[0]['step'] + 1}) -> "
                                f"{last['reward_mean']:.4f} (step {last['step'] + 1})"))
    else:
        facts.append(("loss", f"{metrics[0]['loss']:.4f} -> {last['loss']:.4f}"))
    head = "".join(f"<tr><th>{k}</th><td>{html.escape(v)}</td></tr>" for k, v in facts)
    title = f"slurm-rlhf report: {html.escape(run.name)}"
    body = f"""<!doctype html><html><head><meta charset="utf-8"><title>{title}</title>
<style>{STYLE}</style></head><body>
<h1>{title}</h1><table>{head}</table>
<h2>Curves</h2>{_figure("curves", plots.curves(metrics), target, "curves")}
<h2>Step time by phase</h2>{_figure("step_time", plots.step_time(metrics), target, "step time by phase")}
<h2>Evaluation</h2>{_evaluation_section(_evaluations(run), target)}
<h2>Timeline of the last {len(window) - 1 if len(window) > last_steps else len(window)} steps</h2>
{_figure("timeline", plots.timeline(timelines, start, last["time"]), target, "timeline")}
<h2>Samples</h2>{_samples_section(run, samples_at)}
<h2>Placement</h2><pre>{html.escape(_placement(run))}</pre>
<h2>Config</h2><pre>{html.escape((run / "config.yaml").read_text())}</pre>
<p>Every metric, step by step: {html.escape(str(run / "metrics.jsonl"))}; curves in TensorBoard:
<code>tensorboard --logdir {html.escape(str(run / "tensorboard"))}</code></p>
</body></html>
"""
    page = target / "index.html"
    tmp = target / ".index.html.tmp"
    tmp.write_text(body)
    os.replace(tmp, page)
    return page
