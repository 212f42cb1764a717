"""`slurm-rlhf eval RUN_DIR`: an RL run's checkpoints scored, by the run's own rewards, on prompts it did not
train on.

The prompts are the rows the run held out (`data.eval_fraction`: RL leaves them out of its prompts), or
the rows of a file (`--input`, read with the run's data keys, as its prompts were). Each checkpoint the
run has (or those of `--steps`) samples every prompt `--n` times, greedily by default, the prompt
rendered and cut as the generators do (data.chat_template, rollout.max_prompt_tokens). The run's reward
components (reward.functions and reward.models, weighted and clipped) score the samples with the
scorer's own code.

Written: a table, one row per checkpoint; RUN_DIR/eval/<name>/summary.jsonl (one line per checkpoint,
with the settings it was sampled with; a checkpoint evaluated again replaces its line; lines of other
settings are refused, the name is one curve; the name in-run is the run's own record, refused) and
step-NNNNNN.jsonl (every sample, its reward and each component); TensorBoard scalars (tags `eval/...`,
at the checkpoint's step, its policy version) in RUN_DIR/tensorboard/eval-<name>, a run of its own beside
the training curves, written again from summary.jsonl each time. Every file is written whole under a
temporary name and renamed, readable by its owner alone.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from dataclasses import dataclass, replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from toolkit.errors import ConfigError
from toolkit.use.sampler import Sampling, check_input

IN_RUN = "in-run"
"""The name of the evaluations a run makes itself (eval.every_steps): RUN_DIR/eval/in-run."""

SETTINGS = ("input", "prompts", "n", "temperature", "top_p", "max_new_tokens", "ema")
"""The settings that make an evaluation's figures another curve: the lines of a name's summary share them
(status, the report and TensorBoard draw a name as one curve). Not the seed: another seed draws from the
same distribution."""


def in_run_evaluations(run: Path) -> list[dict]:
    """The summary lines of the evaluations `run` made itself (RUN_DIR/eval/in-run/summary.jsonl; none
    before the first)."""
    from toolkit.store.manifest import read_jsonl

    return read_jsonl(Path(run) / "eval" / IN_RUN / "summary.jsonl")


@dataclass
class EvalPrompt:
    id: int        # the row's id in the run's data (held out), or its index in --input
    location: str  # file:line, for errors
    prompt: object  # text, or chat messages
    fields: dict   # the row's other fields, passed to reward functions as in training


def heldout_prompts(cfg) -> list[EvalPrompt]:
    """The prompts the run held out of its RL part (data.eval_fraction)."""
    from toolkit.data.dataset import StageData

    held = StageData(cfg.data, "rl", "prompt", cfg.run.seed).eval
    if not held:
        raise ConfigError(f"the run holds out no prompts (data.eval_fraction is {cfg.data.eval_fraction:g}"
                          f"{', and none of its rows fell in that share' if cfg.data.eval_fraction else ''}): give "
                          "prompts to evaluate on with --input FILE, or set data.eval_fraction in the next run")
    return [EvalPrompt(e.id, e.location, e.prompt, e.fields) for e in held]


def file_prompts(path: str, cfg) -> list[EvalPrompt]:
    """The rows of `path` as prompts, read with the run's data keys (data.prompt_key, messages_key,
    input_key): ConfigError naming the file and line of a bad row."""
    from toolkit.data.examples import example_of
    from toolkit.data.sources import read_source

    check_input(path)
    keys = cfg.data  # (the run's: a row without its prompt is fixed in the file, not by a setting)
    fix = (f"--input is read with the run's data keys: give every row its prompt in field {keys.prompt_key!r} (the "
           f"run's data.prompt_key) or chat messages in {keys.messages_key!r} (data.messages_key)")
    examples = [example_of(row, "prompt", keys, k, fix) for k, row in enumerate(read_source(path))]
    return [EvalPrompt(e.id, e.location, e.prompt, e.fields) for e in examples]


def eval_name(name: str | None, input_path: str | None) -> str:
    """What the results are filed under: `name`, else `heldout` for the held-out prompts and `file-<stem>` for
    an --input file (a file named heldout.jsonl is not the run's held-out prompts)."""
    if name is None:
        name = "file-" + re.sub(r"[^A-Za-z0-9_-]+", "-", Path(input_path).stem) if input_path else "heldout"
    if not re.fullmatch(r"[A-Za-z0-9_-]+", name):
        raise ConfigError(f"--name {name!r}: use letters, digits, '-' and '_' (it names a directory)")
    if name == IN_RUN:  # (status, the driver's resume and the W&B catch-up read it as the run's own record)
        raise ConfigError(f"--name {IN_RUN}: that is the run's own evaluations (eval.every_steps, RUN_DIR/eval/"
                          f"{IN_RUN}), which status, resume and W&B read as the run's record; choose another name")
    return name


def check_settings(summary: Path, name: str, settings: dict) -> None:
    """ConfigError where `summary` holds a line sampled with other `SETTINGS` than `settings`: added to it,
    two sets of prompts (or samplings) would be drawn as one curve, a step's line silently replaced."""
    from toolkit.store.manifest import read_jsonl

    for line in read_jsonl(summary):
        differ = [k for k in SETTINGS if k in line and line[k] != settings[k]]
        if differ:
            said = ", ".join(f"{k} {json.dumps(line[k])} (now {json.dumps(settings[k])})" for k in differ)
            raise ConfigError(f"{summary}: step {line['step']} of {name!r} was evaluated with other settings: {said}; "
                              f"a name's lines are one curve (status, report, TensorBoard eval-{name}): give this "
                              "evaluation a name of its own with --name, or the settings of the others")


def reward_scorer(cfg, max_new_tokens: int | None = None):
    """The run's reward components: the scorer's RewardRole, in this process, on its device. `max_new_tokens`:
    the responses' limit where it is not the run's (`--max-new-tokens`): a reward model reads prompt + response
    cut to rollout.max_prompt_tokens + max_new_tokens, and with the run's limit a longer response lost the
    prompt, then its own start."""
    import torch

    from toolkit.roles.scorer import RewardRole

    if max_new_tokens is not None:
        cfg = cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update={"max_new_tokens": max_new_tokens})})

    group = SimpleNamespace(gpus_per_worker=int(torch.cuda.is_available()), roles=["reward"], models=["reward"],
                            workers=1)
    role = RewardRole(SimpleNamespace(cfg=cfg, status={}, group=group))
    role.setup()
    return role


def evaluate(run_dir: str, params: Sampling, input_path: str | None = None, steps: list[int] | None = None,
             name: str | None = None, ema: bool = False, backend: str = "auto", seed: int = 0, echo=print,
             follow_s: float | None = None) -> Path:
    """Evaluate the checkpoints of `run_dir` (those of `steps`; default every one) with `params` (max_new_tokens
    None: the run's rollout.max_new_tokens); the summary file. `follow_s`: then, while the run goes (its
    local driver, or its Slurm job queued or running), look for new checkpoints this often and evaluate
    each as it comes, so that checkpoints pruned later (checkpoint.keep) are scored too."""
    from transformers import AutoTokenizer

    from toolkit.config import load_config
    from toolkit.data.tokens import cut_left, render_prompt
    from toolkit.launch.pipeline import refuse_pipeline_dir
    from toolkit.use.sampler import Sampler, over_context, pick_backend
    from toolkit.use.source import NO_CHECKPOINT, checkpoints, resolve

    run = Path(run_dir)
    refuse_pipeline_dir(run, "evaluate")  # (its RL stage, by name, as report and export say)
    if not (run / "config.yaml").is_file():
        raise ConfigError(f"{run_dir}: not a run directory (no config.yaml); eval scores the checkpoints of an RL run")
    cfg = load_config(run / "config.yaml")
    if cfg.stage != "rl":
        raise ConfigError(f"{run_dir} is an {cfg.stage} stage: eval scores RL checkpoints with the run's rewards "
                          "(an sft or rm stage evaluates itself on its eval rows: data.eval_fraction)")
    if params.max_new_tokens is None:
        params = replace(params, max_new_tokens=cfg.rollout.max_new_tokens)
    found = sorted(checkpoints(run))
    if follow_s is not None and steps is not None:
        raise ConfigError("--follow scores every checkpoint as the run writes it; leave out --steps")
    if follow_s is not None and not found:
        from toolkit.launch.jobs import run_going

        if not run_going(run):
            raise ConfigError(f"{run_dir}: no checkpoint to score, and the run is not going (its local driver "
                              "does not run it, and it has no Slurm job queued or running); start or resume it, "
                              "then follow it")
    if not found and follow_s is None:
        raise ConfigError(f"{run_dir}: {NO_CHECKPOINT}; --follow scores each one as the run writes it")
    if steps is None:
        steps = found
    missing = [s for s in steps if s not in found]
    if missing:
        raise ConfigError(f"{run_dir}: no checkpoint at step(s) {', '.join(map(str, missing))}; it has "
                          f"{', '.join(map(str, found))}")
    name = eval_name(name, input_path)
    prompts = file_prompts(input_path, cfg) if input_path else heldout_prompts(cfg)
    sources = [resolve(str(run), step, ema, "--steps") for step in steps]  # (every copy checked before any loads)
    tokenizer = AutoTokenizer.from_pretrained(str(sources[0].path if sources else cfg.tokenizer_path))
    limit = cfg.rollout.max_prompt_tokens
    tokens = []
    for p in prompts:
        try:
            tokens.append(cut_left(render_prompt(tokenizer, p.prompt, cfg.data.chat_template), limit,
                                   tokenizer.bos_token_id))  # (as the run's generator cuts them)
        except ValueError as e:
            raise ConfigError(f"{p.location}: {e}") from None
    longest = max(map(len, tokens))
    if (takes := over_context(sources[0].path if sources else Path(cfg.model.actor), longest + params.max_new_tokens)):
        raise ConfigError(f"the longest prompt ({longest} tokens; rollout.max_prompt_tokens cuts them) and "
                          f"--max-new-tokens {params.max_new_tokens} are more than the model takes: {takes}; lower "
                          f"--max-new-tokens (the run samples {cfg.rollout.max_new_tokens})")
    for i, rm in enumerate(cfg.reward.models):  # (each reads the whole prompt + response)
        if (takes := over_context(Path(rm.path), longest + params.max_new_tokens)):
            raise ConfigError(f"the longest prompt ({longest} tokens) and --max-new-tokens {params.max_new_tokens} are "
                              f"more than reward.models.{i} ({rm.path}) takes: {takes}; lower --max-new-tokens (the "
                              f"run samples {cfg.rollout.max_new_tokens})")
    settings = {"prompts": len(prompts), "n": params.n, "temperature": params.temperature, "top_p": params.top_p,
                "max_new_tokens": params.max_new_tokens, "seed": seed, "ema": ema,
                "input": str(Path(input_path).resolve()) if input_path else "held out (data.eval_fraction)"}
    summary = run / "eval" / name / "summary.jsonl"
    check_settings(summary, name, settings)
    echo(f"evaluating {len(steps)} checkpoint(s) of {run}{' and each one it writes next' * (follow_s is not None)} "
         f"on {len(prompts)} prompt(s) ({settings['input']}), "
         f"{params.n} sample(s) each of at most {params.max_new_tokens} tokens, temperature {params.temperature:g}")
    rewards = reward_scorer(cfg, params.max_new_tokens)
    sampler = None  # (one vLLM engine for every checkpoint: each next one's weights are loaded into it)
    done = set(steps)

    def started_with(path: Path, weights: str):
        echo(f"(sampling with {pick_backend(backend)}, started with {weights})")
        return Sampler(path, backend, longest + params.max_new_tokens, seed, tokenizer=tokenizer)

    try:
        if follow_s is not None and pick_backend(backend) == "vllm":  # (started while it waits for checkpoints,
            sampler = started_with(Path(cfg.model.actor), "the run's first weights, model.actor")  # loaded in place)
        while sources or follow_s is not None:
            if not sources and not (sources := _next_checkpoints(run, done, ema, follow_s, echo)):
                break
            source = sources.pop(0)
            started = time.monotonic()
            try:
                sampler = _loaded(sampler, source, started_with)
            except Exception:
                if (source.path / "config.json").exists():
                    raise
                echo(f"step {source.step}: passed over, its checkpoint was removed before it was read "
                     "(checkpoint.keep; --follow scores those the run still keeps when it looks)")
                if sampler is not None:
                    sampler.close()  # (its weights may be half loaded)
                    sampler = None
                continue
            batch = _batch(source.step, prompts, tokens, sampler.sample(tokens, params))
            with rewards._on_device():
                rewards.score(batch)
            record = {"step": source.step, **summary_of(batch, params.n),
                      "eval_s": round(time.monotonic() - started, 3), **settings}
            write_step(run, name, record, batch)  # (after each checkpoint: an eval stopped part-way keeps what it did)
            echo(row_line(record, batch.reward_names))
    finally:
        if sampler is not None:
            sampler.close()
    echo(f"wrote {summary} (and the samples of each step beside it); TensorBoard: {run / 'tensorboard'} "
         f"(run eval-{name})")
    return summary


def write_step(run: Path, name: str, record: dict, batch) -> None:
    """One evaluated step of `run`: its samples (eval/<name>/step-NNNNNN.jsonl), its line of summary.jsonl
    (replacing a line of that step from before), and the TensorBoard scalars of every line (eval-<name>)."""
    from toolkit.store.manifest import read_jsonl

    out = run / "eval" / name
    for directory in (out.parent, out):
        directory.mkdir(exist_ok=True, mode=0o700)
    _write_jsonl(out / f"step-{record['step']:06d}.jsonl", _sample_rows(batch))
    lines = {r["step"]: r for r in read_jsonl(out / "summary.jsonl")}
    lines[record["step"]] = record
    merged = [lines[s] for s in sorted(lines)]
    _write_jsonl(out / "summary.jsonl", merged)
    _write_curves(run / "tensorboard" / f"eval-{name}", merged)


def _loaded(sampler, source, start):
    """`sampler` with the weights of checkpoint `source` loaded in place, or a new one (`start`)."""
    if sampler is not None and sampler.load_weights(source.path):
        return sampler
    if sampler is not None:
        sampler.close()
    return start(source.path, f"the weights of step {source.step}")


def _next_checkpoints(run: Path, done: set[int], ema: bool, every_s: float, echo) -> list:
    """The checkpoints of `run` written since those in `done` (added to it), looked for every `every_s`
    seconds while the run goes; [] once it has ended and none is new. One removed before it was read
    (checkpoint.keep) is passed over, said."""
    from toolkit.launch.jobs import run_going
    from toolkit.use.source import checkpoints, resolve

    said = False
    while True:
        going = run_going(run)  # (before the look: a checkpoint written just before the end is still found)
        sources = []
        for step in sorted(set(checkpoints(run)) - done):
            done.add(step)
            try:
                sources.append(resolve(str(run), step, ema, "--steps"))
            except ConfigError as e:
                echo(f"step {step}: passed over, {e}")
        if sources or not going:
            return sources
        if not said:
            echo(f"waiting for the next checkpoint ({going}; looking every {every_s:g} s)")
            said = True
        time.sleep(every_s)


def _batch(step: int, prompts: list[EvalPrompt], tokens: list[list[int]], samples: list[list]):
    """The samples of every prompt as a SampleBatch, as the scorer gets them from a generator."""
    from toolkit.samples import SampleBatch, ragged

    flat = [(k, j, s) for k, row in enumerate(samples) for j, s in enumerate(row)]
    response_tokens, response_offsets = ragged([s.token_ids for _, _, s in flat], np.int32)
    prompt_tokens, prompt_offsets = ragged([tokens[k] for k, _, _ in flat], np.int32)
    return SampleBatch(
        step=step, prompt_ids=np.asarray([prompts[k].id for k, _, _ in flat], np.int64),
        group_index=np.asarray([k for k, _, _ in flat], np.int32),
        sample_index=np.asarray([j for _, j, _ in flat], np.int32),
        policy_version=np.full(len(flat), step, np.int32), prompt_tokens=prompt_tokens, prompt_offsets=prompt_offsets,
        response_tokens=response_tokens, response_offsets=response_offsets,
        behaviour_logprobs=np.zeros(len(response_tokens), np.float32),
        finished=np.asarray([s.finished for _, _, s in flat], bool), prompts=[prompts[k].prompt for k, _, _ in flat],
        responses=[s.text for _, _, s in flat], fields=[prompts[k].fields for k, _, _ in flat])


def summary_of(batch, n: int) -> dict:
    """The figures of an evaluated step: reward (each component, best of n), length, finished share."""
    total = batch.reward_total.astype(np.float64)
    out = {"samples": len(batch), "reward_mean": float(total.mean()), "reward_std": float(total.std()),
           "response_len_mean": float(batch.response_lengths.mean()), "finished_frac": float(batch.finished.mean())}
    if n > 1:  # (best of n: the mean over prompts of each prompt's best sample)
        out["reward_best_of_n_mean"] = float(total.reshape(-1, n).max(axis=1).mean())
    for k, component in enumerate(batch.reward_names):
        out[f"reward/{component}"] = float(batch.rewards[:, k].astype(np.float64).mean())
    return out


def _sample_rows(batch) -> list[dict]:
    return [{"prompt_id": int(batch.prompt_ids[i]), "sample": int(batch.sample_index[i]), "prompt": batch.prompts[i],
             "response": batch.responses[i], "response_tokens": int(batch.response_lengths[i]),
             "finished": bool(batch.finished[i]), "reward": float(batch.reward_total[i]),
             **{f"reward/{c}": float(batch.rewards[i, k]) for k, c in enumerate(batch.reward_names)}}
            for i in range(len(batch))]


def row_line(record: dict, components: list[str]) -> str:
    parts = [f"step {record['step']:>6}", f"reward {record['reward_mean']:+.4f} (std {record['reward_std']:.4f})"]
    if "reward_best_of_n_mean" in record:
        parts.append(f"best of {record['n']} {record['reward_best_of_n_mean']:+.4f}")
    if len(components) > 1:
        parts += [f"{c} {record[f'reward/{c}']:+.4f}" for c in components]
    parts += [f"length {record['response_len_mean']:.1f}", f"finished {record['finished_frac']:.2f}",
              f"{record['eval_s']:.1f} s"]
    return "  ".join(parts)


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    """`rows` as JSON Lines, whole or not at all (a temporary name, fsync, rename), mode 600."""
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _write_curves(directory: Path, records: list[dict]) -> None:
    """The summary's numbers as TensorBoard scalars (eval/<name>), the directory written again whole."""
    from toolkit.launch.curves import eval_scalars, summary_writer

    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True, mode=0o700)
    writer = summary_writer()(str(directory))
    try:
        for r in records:
            for name, value in eval_scalars(r).items():
                writer.add_scalar(name, value, r["step"])
    finally:
        writer.close()
