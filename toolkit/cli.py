"""The `slurm-rlhf` command. Parses arguments first and imports heavy modules only in the chosen command,
so `--help` is instant."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shlex
import shutil
import sys
import time
from pathlib import Path

from toolkit.command import run_command
from toolkit.errors import ConfigError, ToolkitError
from toolkit.launch.openmp import wait_passively

EXAMPLES = """examples:
  slurm-rlhf run templates/examples/tiny-grpo.yaml --run-dir runs/demo
  slurm-rlhf sft sft.yaml                       # supervised fine-tuning (stage sft)
  slurm-rlhf rm rm.yaml                         # reward-model training (stage rm)
  slurm-rlhf run pipeline.yaml                  # sft -> rm -> rl, here, one after the other
  slurm-rlhf submit pipeline.yaml --wait        # one Slurm job per stage, chained (afterok)
  slurm-rlhf run run.yaml --set rollout.group_size=8 --set trainer.lr=1e-6
  slurm-rlhf submit run.yaml --dry-run          # the placement and the batch script, nothing submitted
  slurm-rlhf submit run.yaml --run-dir runs/r1  # one Slurm allocation, one srun step per node group
  slurm-rlhf status runs/r1
  slurm-rlhf cancel runs/r1
  slurm-rlhf resume runs/r1                     # continue from the last checkpoint and committed experience
  slurm-rlhf inspect runs/r1/experience/step-000003.h5
  slurm-rlhf render run.yaml --run-dir runs/r2  # a batch script to submit by hand
  slurm-rlhf validate run.yaml
  slurm-rlhf plan run.yaml --cluster templates/clusters/2x8-h100.yaml --write planned.yaml
  slurm-rlhf tiny models/tiny
  slurm-rlhf init --model models/tiny/model --cluster templates/clusters/2x8-h100.yaml --out run.yaml
  slurm-rlhf export runs/r1 out/model [--step 40] [--ema]   # a checkpoint as a Hugging Face model directory
  slurm-rlhf generate runs/r1 --input prompts.jsonl --output samples.jsonl --n 4
  slurm-rlhf eval runs/r1                       # score every checkpoint on the prompts the run held out
  slurm-rlhf chat runs/r1                       # talk to the newest checkpoint (or any model directory)
  slurm-rlhf report runs/r1                     # runs/r1/report/index.html: curves, phases, timeline, samples
"""


PRELOADS = ("It samples in its own process as a run's workers do, with the same libraries preloaded: tcmalloc (else "
            "jemalloc) and, on an AMD CPU, the one that makes Intel MKL take its fast kernels (about twice the speed "
            "of torch's matrix products there). SLURM_RLHF_ALLOCATOR=system and SLURM_RLHF_FAST_MKL_ON_AMD=0 "
            "turn them off.")


def _add_config_args(p: argparse.ArgumentParser, example: str = "rollout.group_size=8") -> None:
    """`example`: a --set that the command's configs take (an sft or rm config has no `rollout`)."""
    p.add_argument("config", help="run config (YAML)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help=f"override a config value, e.g. --set {example} (repeatable; a relative "
                        "path is taken from the current folder, not the config's)")


def _add_checkpoint_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--step", type=int, help="the checkpoint at this step (default: the newest)")
    p.add_argument("--ema", action="store_true", help="the checkpoint's EMA copy (runs with trainer.ema)")


def _add_model_args(p: argparse.ArgumentParser, temperature: float = 1.0) -> None:
    p.add_argument("model", help="a run directory (its newest checkpoint) or a Hugging Face model directory")
    _add_checkpoint_args(p)
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens per response at most (default 128)")
    p.add_argument("--temperature", type=float, default=temperature,
                   help=f"sampling temperature; 0 is greedy (default {temperature})")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (default 1.0: off)")
    p.add_argument("--seed", type=_seed, default=0,
                   help="sample j of prompt k is drawn with a seed of its own, a hash of (seed, k, j) (default 0)")
    p.add_argument("--backend", choices=("auto", "vllm", "hf"), default="auto",
                   help="vllm, or transformers generate (hf); auto: vllm where installed")
    p.add_argument("--max-model-len", type=int, help="the engine's context length (default: generate, the longest "
                                                     "prompt + --max-new-tokens; chat, the model's, at most 2048)")


def _add_run_dir_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--run-dir", type=_not_empty, help="directory for config, logs, metrics (default: runs/<run.name>)")


def _not_empty(value: str) -> str:
    if not value:
        raise argparse.ArgumentTypeError("empty; give a directory, or leave the option out for runs/<run.name>")
    return value


def _seed(value: str) -> int:
    """A seed within the bounds a run's config takes (vLLM and numpy refuse others, vLLM only after start-up)."""
    from toolkit.seeds import SEED_LIMIT, seed_problem
    try:
        seed = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a whole number; give a seed from 0 to {SEED_LIMIT - 1}")
    problem = seed_problem(seed)
    if problem:
        raise argparse.ArgumentTypeError(f"{seed} is out of range: {problem}")
    return seed


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="slurm-rlhf", description="Slurm-native RLHF (PPO, GRPO) without Ray.",
                                     epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__import__('toolkit').__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("run", help="run a config on this machine (workers as local processes): an RL run, "
                                   "an sft or rm stage, or a pipeline of them")
    _add_config_args(p)
    _add_run_dir_arg(p)
    p.add_argument("--verbose", "-v", action="store_true", help="show worker registration and debug records")

    for stage, what in (("sft", "supervised fine-tuning: the loss on the response tokens"),
                        ("rm", "reward-model training on preference pairs")):
        p = sub.add_parser(stage, help=f"run an {stage} stage on this machine ({what})")
        _add_config_args(p, example="train.lr=2e-5")
        _add_run_dir_arg(p)
        p.add_argument("--verbose", "-v", action="store_true", help="show worker registration and debug records")

    p = sub.add_parser("resume", help="continue a run (or a pipeline) from its last checkpoint and committed "
                                      "experience")
    p.add_argument("run_dir")
    p.add_argument("--submit", action="store_true", help="resume as a new Slurm job instead of on this machine")
    p.add_argument("--wait", action="store_true", help="with --submit: follow the job until it ends")
    p.add_argument("--data-changed", action="store_true",
                   help="go on with the data files as they are now, though they changed since the run started "
                        "(the next steps draw from a new order of the rows)")
    p.add_argument("--verbose", "-v", action="store_true", help="show worker registration and debug records")

    p = sub.add_parser("inspect", help="summarise an experience file, or list the experience files and checkpoints "
                                       "a run directory holds")
    p.add_argument("path", help="experience/step-NNNNNN.h5, or a run directory")

    p = sub.add_parser("submit", help="submit to Slurm: one allocation per stage, one srun step per node group; "
                                      "a pipeline's stages as jobs chained with --dependency=afterok")
    _add_config_args(p)
    _add_run_dir_arg(p)
    p.add_argument("--dry-run", action="store_true", help="print the placement and the batch script (a pipeline: "
                                                           "each stage's placement and its jobs); submit nothing")
    p.add_argument("--wait", action="store_true", help="follow the job's output until it ends; exit 0 only if the "
                                                        "run finished")

    p = sub.add_parser("render", help="write a batch script for the run, to submit by hand with sbatch")
    _add_config_args(p)
    _add_run_dir_arg(p)

    p = sub.add_parser("status", help="state of a run (Slurm job, steps, every worker's node and phase), or of "
                                      "every stage of a pipeline")
    p.add_argument("run_dir")

    p = sub.add_parser("cancel", help="cancel a run's (or a pipeline's) Slurm jobs, or stop its local driver, and "
                                      "wait for the end")
    p.add_argument("run_dir")

    p = sub.add_parser("validate", help="check a config and print it resolved (paths, defaults)")
    _add_config_args(p)

    p = sub.add_parser("plan", help="rank placements and parallel settings for a cluster by estimated step time")
    _add_config_args(p)
    p.add_argument("--cluster", required=True, help="cluster file (see templates/clusters/)")
    p.add_argument("--nodes", type=int, default=None, help="plan for this many nodes of the cluster file's kind")
    p.add_argument("--strategy", action="append", default=None, help="only this strategy (repeatable)")
    p.add_argument("--offload", choices=("auto", "on", "off"), default="auto",
                   help="placement.offload in the plans: weighed both ways on GPU clusters (auto, the default), "
                        "or only on or off")
    p.add_argument("--top", type=int, default=None,
                   help="plans shown (default 10; with --json: every plan kept unless given)")
    p.add_argument("--json", action="store_true",
                   help="print the plans kept (the 200 fastest; the 200 closest to fitting, and the closest of each "
                        "strategy) as JSON for scripts: "
                        "strategy, groups, settings, seconds per phase, memory per group, and whether it fits or why not")
    p.add_argument("--params", action="append", default=[], metavar="MODEL=COUNT",
                   help="a model by its parameter count instead of its config.json, e.g. actor=7e9 "
                        "(actor, reference, critic, reward)")
    p.add_argument("--prompt-tokens", type=float, help="mean prompt tokens (default: measured on the data file)")
    p.add_argument("--response-tokens", type=float, help="mean response tokens (default: rollout.max_new_tokens)")
    p.add_argument("--write", type=Path, metavar="OUT.yaml", help="write the run config with the best plan")
    p.add_argument("--force", action="store_true", help="replace --write's file if it exists")

    p = sub.add_parser("export", help="write a run's checkpoint as a Hugging Face model directory (LoRA merged)")
    p.add_argument("run_dir")
    p.add_argument("out", help="the model directory to write (new, or empty)")
    _add_checkpoint_args(p)

    p = sub.add_parser("generate", help="sample responses to a JSON Lines file of prompts, from a run's "
                                        "checkpoint or any Hugging Face model directory", epilog=PRELOADS)
    _add_model_args(p)
    p.add_argument("--input", required=True, help='JSON Lines, one {"prompt": text or chat messages} per line '
                                                  "(or a .json array of such rows)")
    p.add_argument("--prompt-key", default="prompt", metavar="KEY",
                   help="the field with the prompt (default prompt; a row without it may give messages)")
    p.add_argument("--input-key", metavar="KEY", help="Alpaca's input field (e.g. input), joined to a text "
                                                     "prompt after a blank line where not empty")
    p.add_argument("--output", default="-", help="JSON Lines to write, one line per sample: the input row's fields "
                                                 "and sample, response, response_tokens, finished, logprob (a row "
                                                 "with a field of those names is refused) (default: standard output)")
    p.add_argument("--n", type=int, default=1, help="samples per prompt (default 1)")
    p.add_argument("--chat-template", choices=("auto", "on"), default="auto",
                   help="auto: chat messages through the tokenizer's chat template, text as it is; on: text too, "
                        "as a user message")
    p.add_argument("--force", action="store_true", help="replace --output if it exists")

    p = sub.add_parser("eval", help="score an RL run's checkpoints, by its own rewards, on prompts it held out "
                                    "(data.eval_fraction) or on a file of prompts",
                       epilog=PRELOADS + " Without them set, it follows the run's run.allocator and "
                                         "run.fast_mkl_on_amd.")
    p.add_argument("run_dir")
    p.add_argument("--input", help="a file of prompts (JSON Lines, Parquet or a saved dataset, read with the run's "
                                   "data keys; default: the prompts the run held out)")
    p.add_argument("--steps", metavar="STEP,STEP,...", help="the checkpoints to score (default: every one)")
    p.add_argument("--name", help="what the results are filed under: RUN_DIR/eval/NAME (default: heldout, or "
                                  "file-STEM for --input STEM.jsonl); one name is one curve: adding lines of other "
                                  "prompts or sampling settings to it is refused")
    p.add_argument("--ema", action="store_true", help="the checkpoints' EMA copies (runs with trainer.ema)")
    p.add_argument("--n", type=int, default=1, help="samples per prompt (default 1)")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default 0: greedy)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (default 1.0: off)")
    p.add_argument("--max-new-tokens", type=int, help="tokens per response at most (default: rollout.max_new_tokens)")
    p.add_argument("--seed", type=_seed, default=0, help="sample j of prompt k is drawn with a seed of its own, a hash "
                                                       "of (seed, k, j) (default 0)")
    p.add_argument("--backend", choices=("auto", "vllm", "hf"), default="auto",
                   help="vllm, or transformers generate (hf); auto: vllm where installed")
    p.add_argument("--follow", action="store_true",
                   help="then score each checkpoint the run writes next, as it comes, until the run ends (its "
                        "local driver, or its Slurm job); checkpoints that checkpoint.keep prunes later are scored too")
    p.add_argument("--poll-s", type=float, default=30.0, help="with --follow: how often to look (default 30 s)")

    p = sub.add_parser("chat", help="talk to a run's checkpoint or any Hugging Face model, one turn per line "
                                    "('clear' starts over, 'quit', 'exit' or Ctrl-D ends)", epilog=PRELOADS)
    _add_model_args(p, temperature=0.7)

    p = sub.add_parser("report", help="write an HTML page with plots about a run: curves, step time by phase, "
                                      "a timeline of every worker, samples, config and placement")
    p.add_argument("run_dir")
    p.add_argument("--out", help="directory to write index.html and the PNGs into (default: RUN_DIR/report)")
    p.add_argument("--samples-at", metavar="STEP,STEP,...",
                   help="steps whose samples to show, numbered from 1 as the progress line numbers them "
                        "(default: the first, middle and last committed)")
    p.add_argument("--last-steps", type=int, default=4, help="steps the timeline shows (default 4)")
    p.add_argument("--force", action="store_true", help="write into an --out folder that holds files report did "
                                                        "not write (its index.html and PNGs are replaced)")

    p = sub.add_parser("init", help="write a commented starter config for a model, sized for a cluster by the "
                                    "planner; it validates as written")
    p.add_argument("--model", required=True, help="the policy to train: a Hugging Face model directory")
    p.add_argument("--cluster", help="cluster file (see templates/clusters/): plan the placement for it "
                                     "(default: run on this machine)")
    p.add_argument("--prompts", help="JSON Lines of prompts (default: example prompts written beside the config)")
    p.add_argument("--reward-model", help="a reward model directory (default: a placeholder rule-based reward)")
    p.add_argument("--algorithm", choices=("grpo", "ppo", "rloo", "reinforce_pp"), default="grpo")
    p.add_argument("--out", default="run.yaml", help="the config to write (default: run.yaml)")
    p.add_argument("--force", action="store_true", help="replace --out if it exists")

    p = sub.add_parser("tiny", help="build a tiny Llama, tokenizer, reward model and prompts offline")
    p.add_argument("out_dir", help="directory to write (model/, reward_model/, prompts.jsonl, pipeline.jsonl); "
                                   "one already built with the same seed is kept as it is")
    p.add_argument("--seed", type=_seed, default=0, help="seed of the weights and the data (default 0)")
    return parser


def _load(args, stage: str | None = None):
    """(the config, None) of a stage config, or (None, the pipeline) of a pipeline file; data checked."""
    from toolkit.config import load_config
    from toolkit.config.pipeline import is_pipeline, load_pipeline

    if stage is None and is_pipeline(args.config):
        return None, load_pipeline(args.config, args.overrides)
    cfg = load_config(args.config, args.overrides, stage)
    from toolkit.data.dataset import check_data

    check_data(cfg)  # bad data is a config error, found before any process
    return cfg, None


def _pipeline_configs(pipeline, directory: Path) -> list:
    from toolkit.data.dataset import check_data

    configs = pipeline.configs(directory)
    for cfg in configs:
        try:
            check_data(cfg)
        except ConfigError as e:  # (which stage's rows: several read the same file)
            raise ConfigError(f"stage {cfg.stage}: {e}") from None
    return configs


def cmd_run(args, stage: str | None = None) -> int:
    from toolkit.launch.here import run_here
    from toolkit.launch.rundir import RunDir

    cfg, pipeline = _load(args, stage)
    if pipeline is not None:
        from toolkit.launch.pipeline import PipelineDir, run_pipeline_here

        pd = PipelineDir(args.run_dir or Path("runs") / pipeline.name)
        configs = _pipeline_configs(pipeline, pd.path)
        return run_pipeline_here(configs, pd.create(pipeline, args.overrides), args.verbose)
    run_dir = RunDir(args.run_dir or Path("runs") / cfg.run.name).create(cfg)
    return run_here(cfg, run_dir, args.verbose)


def _check_checkpoints(run_dir) -> None:
    """Refuse to submit a resume from a run directory whose checkpoints someone else could have written
    (store/ownership.py): every checkpoint the run still holds, since the resume falls back to an older one
    where the newest is damaged. Only looks at the files' owners and modes; the job checks their contents."""
    from toolkit.store.manifest import Manifest, live_checkpoints
    from toolkit.store.ownership import check_ours_alone

    for record in live_checkpoints(Manifest(run_dir.path).records()).values():
        directory = run_dir.path / record["dir"]
        if directory.is_dir():
            check_ours_alone(directory)


def cmd_resume(args) -> int:
    from toolkit.config import load_config
    from toolkit.launch.jobs import follow, live_job, open_run
    from toolkit.launch.pipeline import PipelineDir, is_pipeline_dir

    if args.wait and not args.submit:
        raise ConfigError("resume --wait follows a submitted job: add --submit (without it the run resumes on "
                          "this machine, in the foreground)")
    if args.verbose and args.submit:
        raise ConfigError("resume --verbose is for a resume on this machine; a submitted job's driver writes "
                          "every record to RUN_DIR/logs/driver.log")
    if is_pipeline_dir(args.run_dir):
        return _resume_pipeline(PipelineDir(args.run_dir), args)
    run_dir = open_run(args.run_dir)
    cfg = load_config(run_dir.config)
    job = live_job(run_dir)
    if job:
        raise ConfigError(f"{run_dir.path} is still running: its {job}; let it end (a requeued job resumes by "
                          f"itself), or stop it with `slurm-rlhf cancel {run_dir.path}`, then resume")
    run_dir.hold_lock()  # (a local driver still running holds it)
    status = run_dir.read_json(run_dir.status)
    if status.get("state") == "finished":
        by_epochs = cfg.stage != "rl" and not cfg.run.steps  # (an sft or rm stage's steps follow from its rows)
        planned = cfg.total_steps(_train_rows(status, cfg, args.data_changed)) if by_epochs else cfg.run.steps
        if planned <= status.get("steps", 0):
            print(f"{run_dir.path}: the run finished all its {status['steps']} steps, nothing to resume (to train "
                  f"longer, raise {'run.epochs' if by_epochs else 'run.steps'} in {run_dir.config}, then resume)",
                  flush=True)
            return 0
    if args.data_changed:
        _accept_data(run_dir, cfg)
    if not args.submit:
        from toolkit.launch.here import run_here

        return run_here(cfg, run_dir, args.verbose)
    from toolkit.launch.allocation import plan_allocation
    from toolkit.launch.submit import submit
    from toolkit.placement.plan import plan

    _check_checkpoints(run_dir)  # (the job's driver checks too, but only after the job waited in the queue)
    run_dir.release_lock()  # (the job's driver runs the directory now)
    job_id = submit(cfg, plan_allocation(plan(cfg), cfg.slurm.heterogeneous), run_dir)
    run_dir.update_job(job_id=job_id, submitted=time.time(), requeues=0)
    print(f"submitted slurm job {job_id} to resume {run_dir.path}", flush=True)
    return follow(run_dir, job_id) if args.wait else 0


def _train_rows(status: dict, cfg, data_changed: bool) -> int:
    """The training rows of a finished supervised stage: as its driver recorded them in status.json, unless
    the data files changed since (then, or for a run that did not record them, the data is read)."""
    if "train_rows" in status and not data_changed:
        return status["train_rows"]
    from toolkit.data.dataset import check_data

    return check_data(cfg).train_rows


def _accept_data(run_dir, cfg) -> None:
    """Record the data files and the settings that decide the draws as they are now as the run's (resume
    --data-changed)."""
    from toolkit.data.fingerprint import draw_settings, fingerprint
    from toolkit.store.manifest import Manifest

    Manifest(run_dir.path).append({"kind": "data", "files": fingerprint(cfg), "draws": draw_settings(cfg),
                                   "accepted": True})
    print(f"{run_dir.path}: going on with the data files and draw settings as they are now", flush=True)


@contextlib.contextmanager
def in_folder(path: str | None):
    """The current folder is `path` while the block runs (where it is given and still there)."""
    before = os.getcwd()
    if path and os.path.isdir(path):
        os.chdir(path)
    try:
        yield
    finally:
        os.chdir(before)


def _resume_pipeline(pd, args) -> int:
    """Continue a pipeline from its first stage that did not finish (here, or as chained Slurm jobs)."""
    from toolkit.config import load_config
    from toolkit.config.pipeline import load_pipeline
    from toolkit.launch.jobs import live_job
    from toolkit.launch.pipeline import (check_started, finished, follow_pipeline, pipeline_jobs, run_pipeline_here,
                                         started, submit_pipeline)

    overrides, folder = pd.overrides()
    if overrides:  # (as when it started: a stage not started yet must not run with the file's bare values)
        print(f"pipeline: with the --set overrides it was started with: {' '.join(map(shlex.quote, overrides))}",
              flush=True)
    source = pd.source()
    if not Path(source).is_file():
        raise ConfigError(f"{pd.path} was started from the pipeline file {source}, which is gone; resume reads it "
                          "again (the stages not started yet run as it says, and its paths are relative to its "
                          "folder): put it, or a copy of it, back at that path, then resume")
    with in_folder(folder):  # (their relative paths meant what they meant there)
        pipeline = load_pipeline(source, overrides)
    configs = _pipeline_configs(pipeline, pd.path)
    for stage in pd.stages():
        job = live_job(pd.stage(stage))
        if job:
            raise ConfigError(f"{pd.path} is still running: stage {stage}'s {job}; let it end, or stop the "
                              f"pipeline with `slurm-rlhf cancel {pd.path}`, then resume")
    check_started(configs, pd)
    if args.data_changed:  # (each stage that started and did not finish: one not started has no data record)
        for stage in pd.stages():
            rd = pd.stage(stage)
            if started(rd) and not finished(rd):
                _accept_data(rd, load_config(rd.config))
    if not args.submit:
        return run_pipeline_here(configs, pd, args.verbose)
    jobs = submit_pipeline(pipeline_jobs(configs, pd), pd)
    if not jobs:
        print(f"{pd.path}: every stage finished, nothing to resume", flush=True)
    for stage, job_id in jobs:
        print(f"submitted slurm job {job_id} for stage {stage}", flush=True)
    return follow_pipeline(pd, jobs) if args.wait and jobs else 0


def cmd_inspect(args) -> int:
    from toolkit.launch.jobs import open_run
    from toolkit.launch.pipeline import refuse_pipeline_dir
    from toolkit.store.experience import summary
    from toolkit.store.manifest import Manifest, held_experience, live_checkpoints

    path = Path(args.path)
    refuse_pipeline_dir(path, "inspect")
    if path.is_dir():
        open_run(path, "; give a run directory, or one of its experience/step-NNNNNN.h5 files")
        # (what the run holds now: a step's last commit, not one set aside on a resume; no checkpoint removed)
        records = Manifest(path).records()
        experience, checkpoints = held_experience(path, records), live_checkpoints(records)
        if not experience and not checkpoints:
            raise ConfigError(f"{path}: no experience or checkpoint in its manifest")
        print("(steps counted from 1, as the progress line does; experience files are named from 0)")
        for step, r in experience.items():
            print(f"experience step {step + 1:>6}  {r['file']}")
        for step, r in sorted(checkpoints.items()):  # (a checkpoint's step: the steps trained before it)
            print(f"checkpoint step {step:>6}  {r['dir']}")
        return 0
    if not path.is_file():
        raise ConfigError(f"{path}: no such file")
    try:
        text = summary(path)
    except (OSError, ValueError, KeyError) as e:  # (h5py: not HDF5; ours: another schema; a group missing)
        raise ConfigError(f"{path}: not an experience file this version reads ({e}); give a run's "
                          "experience/step-NNNNNN.h5, or the run directory to list them") from None
    print(text)
    return 0


def _prepare(args, cfg=None):
    """Config, placement and allocation of a Slurm run, checked before anything is written."""
    from toolkit.launch.allocation import plan_allocation
    from toolkit.placement.plan import plan

    if cfg is None:
        cfg, pipeline = _load(args)
        if pipeline is not None:
            raise ConfigError(f"{args.config} is a pipeline file; `render` writes the batch script of one stage: "
                              "render each stage's own config, or submit the pipeline")
    groups = plan(cfg)
    return cfg, groups, plan_allocation(groups, cfg.slurm.heterogeneous)


def cmd_submit(args) -> int:
    from toolkit.launch.allocation import placement_table
    from toolkit.launch.jobs import follow
    from toolkit.launch.rundir import RunDir
    from toolkit.launch.submit import submit, submit_script

    cfg, pipeline = _load(args)
    if pipeline is not None:
        return _submit_pipeline(pipeline, args)
    cfg, groups, allocation = _prepare(args, cfg)
    run_dir = RunDir(args.run_dir or Path("runs") / cfg.run.name)
    kind = f"a heterogeneous job of {len(allocation.components)} components" if allocation.heterogeneous else "one job"
    if args.dry_run:
        print(f"placement: {kind}, {allocation.nodes} nodes\n{placement_table(groups, allocation)}\n")
        print(f"batch script (for run directory {run_dir.path}):\n{submit_script(cfg, allocation, str(run_dir.path))}")
        return 0
    given_empty = run_dir.path.is_dir()  # (an empty directory the user made for the run, with --run-dir)
    run_dir.create(cfg)
    try:
        job_id = submit(cfg, allocation, run_dir)
    except ToolkitError:
        _remove_made(run_dir.path, given_empty)  # (made a moment ago for this job, which does not exist)
        raise
    run_dir.update_job(job_id=job_id, submitted=time.time())
    print(f"submitted slurm job {job_id} ({kind}, {allocation.nodes} nodes); run directory {run_dir.path}", flush=True)
    if not args.wait:
        print(f"follow it with: slurm-rlhf status {run_dir.path}")
        return 0
    return follow(run_dir, job_id)


def _submit_pipeline(pipeline, args) -> int:
    from toolkit.launch.allocation import placement_table
    from toolkit.launch.jobs import live_job
    from toolkit.launch.pipeline import PipelineDir, follow_pipeline, pipeline_jobs, submit_pipeline

    pd = PipelineDir(args.run_dir or Path("runs") / pipeline.name)
    configs = _pipeline_configs(pipeline, pd.path)
    if args.dry_run:
        for cfg in configs:
            _, groups, allocation = _prepare(args, cfg)
            print(f"stage {cfg.stage} ({cfg.summary}): {allocation.nodes} node(s)\n{placement_table(groups, allocation)}\n")
        print(f"{len(configs)} jobs, each starting after the one before finished (--dependency=afterok); "
              f"run directory {pd.path}")
        return 0
    todo = pipeline_jobs(configs, pd)
    given_empty = pd.path.is_dir()
    pd.create(pipeline, args.overrides)
    try:
        jobs = submit_pipeline(todo, pd)
    except ToolkitError:  # (all or none: what it had submitted is cancelled)
        if not any(live_job(pd.stage(stage)) for stage in pd.stages()):
            _remove_made(pd.path, given_empty)
        raise
    for stage, job_id in jobs:
        print(f"submitted slurm job {job_id} for stage {stage}; run directory {pd.stage(stage).path}", flush=True)
    if not args.wait:
        print(f"follow it with: slurm-rlhf status {pd.path}")
        return 0
    return follow_pipeline(pd, jobs)


def _remove_made(path: Path, given_empty: bool) -> None:
    """Remove the run (or pipeline) directory that a refused submit made; one that the user made for it, empty,
    stays, emptied."""
    for made in list(path.iterdir()) if given_empty else [path]:
        shutil.rmtree(made) if made.is_dir() else made.unlink()


def cmd_render(args) -> int:
    from toolkit.launch.rundir import RunDir
    from toolkit.launch.sbatch import sbatch_script

    cfg, groups, allocation = _prepare(args)
    run_dir = RunDir(args.run_dir or Path("runs") / cfg.run.name)
    # Rendering again after a config edit rewrites the script, as long as nothing has run from it.
    run_dir = run_dir.rewrite_config(cfg) if run_dir.rendered_only() else run_dir.create(cfg)
    python = cfg.slurm.python or sys.executable
    script = sbatch_script(cfg, allocation, str(run_dir.path), [python, "-m", "toolkit.launch.batch", str(run_dir.path)],
                           how="render")
    path = run_dir.path / "slurm" / "job.sbatch"
    path.parent.mkdir(exist_ok=True)
    run_dir.write_atomic(path, script)
    print(f"wrote {path}\nsubmit it with: sbatch {shlex.quote(str(path))}")
    return 0


def cmd_status(args) -> int:
    from toolkit.launch.jobs import open_run, status_text
    from toolkit.launch.pipeline import PipelineDir, is_pipeline_dir, pipeline_status

    if is_pipeline_dir(args.run_dir):
        print(pipeline_status(PipelineDir(args.run_dir)))
    else:
        print(status_text(open_run(args.run_dir)))
    return 0


def cmd_cancel(args) -> int:
    from toolkit.launch.jobs import cancel, open_run
    from toolkit.launch.pipeline import PipelineDir, cancel_pipeline, is_pipeline_dir

    if is_pipeline_dir(args.run_dir):
        print(cancel_pipeline(PipelineDir(args.run_dir)))
    else:
        print(cancel(open_run(args.run_dir)))
    return 0


def cmd_validate(args) -> int:
    from toolkit.config import dump_config

    cfg, pipeline = _load(args)
    if pipeline is None:
        print(dump_config(cfg) + _resolved_here(cfg), end="")
        return 0
    directory = Path("runs").resolve() / pipeline.name
    for cfg in _pipeline_configs(pipeline, directory):
        print(f"# stage {cfg.stage} (run directory {directory / cfg.stage})\n{dump_config(cfg)}{_resolved_here(cfg)}",
              end="")
    return 0


def _resolved_here(cfg) -> str:
    """Comment lines: what the config's `auto` choices come to on this machine (on Slurm each node decides
    its allocator, and the job's Python whether vLLM is there)."""
    from toolkit.launch import mkl_amd, openmp
    from toolkit.launch.allocator import choice

    lines = []
    if cfg.stage == "rl" and cfg.rollout.backend == "auto":
        engine = cfg.generation_backend
        lines.append(f"# rollout.backend auto: {engine} here (vLLM is {'' if engine == 'vllm' else 'not '}installed)")
    if cfg.run.allocator == "auto":
        name, library = choice("auto")
        lines.append(f"# run.allocator auto: {name} on this machine" + (f" ({library})" if library else ""))
    if cfg.run.fast_mkl_on_amd:
        path, why = mkl_amd.library()
        lines.append("# run.fast_mkl_on_amd: " + (f"MKL's library {path}" if path else f"no effect here ({why})"))
    if openmp.SPIN in os.environ:
        lines.append(f"# run.openmp_spin {cfg.run.openmp_spin}: {openmp.SPIN}={os.environ[openmp.SPIN]} in this "
                     "environment wins (the workers inherit it)")
    elif cfg.run.openmp_spin:
        lines.append(f"# run.openmp_spin: the workers' OpenMP threads spin {cfg.run.openmp_spin} times before they "
                     f"sleep ({openmp.SPIN})")
    return "".join(line + "\n" for line in lines)


def cmd_plan(args) -> int:
    from toolkit.config import load_config
    from toolkit.placement.cluster import load_cluster
    from toolkit.placement.planner import STRATEGIES, as_json, report, search, workload_of, write_config

    cfg = load_config(args.config, args.overrides, "rl")
    cluster = load_cluster(args.cluster)
    if args.nodes is not None:
        if args.nodes < 1:
            raise ConfigError(f"--nodes {args.nodes}: at least 1")
        cluster = cluster.model_copy(update={"nodes": args.nodes})
    if args.top is not None and args.top < 1:
        raise ConfigError(f"--top {args.top}: at least 1")
    for flag, tokens in (("--prompt-tokens", args.prompt_tokens), ("--response-tokens", args.response_tokens)):
        if tokens is not None and not (math.isfinite(tokens) and tokens >= 1):
            raise ConfigError(f"{flag} {tokens:g}: a mean token count, at least 1")
    params = {}
    for item in args.params:
        name, _, count = item.partition("=")
        try:
            params[name] = float(count)
        except ValueError:
            raise ConfigError(f"--params {item!r}: expected MODEL=COUNT, e.g. actor=7e9") from None
        if name not in ("actor", "reference", "critic", "reward"):
            raise ConfigError(f"--params {item!r}: MODEL is one of actor, reference, critic, reward")
        if not (math.isfinite(params[name]) and params[name] > 0):
            raise ConfigError(f"--params {item!r}: COUNT is a positive number of parameters, e.g. actor=7e9")
    for strategy in args.strategy or []:
        if strategy not in STRATEGIES:
            raise ConfigError(f"--strategy {strategy!r}: one of {', '.join(STRATEGIES)}")
    if args.write and Path(args.write).is_dir():
        raise ConfigError(f"--write {args.write} is a directory; give the config file to write, e.g. "
                          f"{Path(args.write) / 'planned.yaml'}")
    if args.write and not Path(args.write).resolve().parent.is_dir():
        raise ConfigError(f"--write {args.write}: its folder {Path(args.write).resolve().parent} does not exist")
    if args.write and Path(args.write).exists() and not args.force:  # (it may be the config planned, with notes)
        raise ConfigError(f"--write {args.write} exists; choose another name, or --force to replace it")
    w = workload_of(cfg, args.prompt_tokens, args.response_tokens, params)
    found = search(cluster, w, cfg.trainer.zero_stage, tuple(args.strategy or STRATEGIES),
                   offload={"auto": None, "on": True, "off": False}[args.offload])
    if args.json:
        print(json.dumps(as_json(cluster, w, found, args.top), indent=1))
    else:
        print(report(cluster, w, found, 10 if args.top is None else args.top))
    if not found.fit:
        return 1
    if args.write:
        write_config(cfg, found.fit[0], args.write, cluster.cpus_per_node)
        print(f"wrote the best plan into {args.write.absolute()}", file=sys.stderr if args.json else sys.stdout)
    return 0


def cmd_export(args) -> int:
    from toolkit.use.export import export

    out = export(args.run_dir, args.out, args.step, args.ema)
    print(f"wrote {out}")
    return 0


def _sampling(args):
    from toolkit.use.sampler import Sampling

    for name in ("max_new_tokens", "n"):
        if (value := getattr(args, name, 1)) is not None and value < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be at least 1")
    if args.temperature < 0 or not 0 < args.top_p <= 1:
        raise ConfigError("--temperature must be >= 0 and --top-p in (0, 1]")
    if getattr(args, "n", 1) > 1 and args.temperature == 0:
        raise ConfigError(f"--n {args.n} with --temperature 0 (greedy): every sample of a prompt would be the same; "
                          "give --temperature (e.g. 0.7), or --n 1")
    from toolkit.config.schema import temperature_problem

    if problem := temperature_problem("--temperature", args.temperature):
        raise ConfigError(problem + " (or 0: greedy)")
    if args.max_model_len is not None and args.max_model_len <= args.max_new_tokens:
        raise ConfigError(f"--max-model-len {args.max_model_len}: the context must hold a prompt and "
                          f"--max-new-tokens {args.max_new_tokens}; give more, or leave it out (the model's own)")
    return Sampling(args.max_new_tokens, args.temperature, args.top_p, getattr(args, "n", 1))


def _as_a_worker(allocator_name: str = "auto", fast_mkl_on_amd: bool = True) -> str:
    """`generate`, `chat` and `eval` sample (and score) in this process, as a run's workers do: the same
    libraries preloaded (this process starts itself again with them, same PID: launch/preload.py). What it
    runs with, for the command's first line."""
    from toolkit.launch import preload

    preload.as_a_worker(allocator_name, fast_mkl_on_amd)
    return preload.describe()


def cmd_generate(args) -> int:
    from toolkit.progress import Progress
    from toolkit.use.generate import generate
    from toolkit.use.source import resolve

    params = _sampling(args)
    if args.output != "-" and Path(args.output).is_dir():  # (--force or not: it failed once every prompt was sampled)
        raise ConfigError(f"--output {args.output} is a directory; give the file to write, e.g. "
                          f"{Path(args.output) / 'samples.jsonl'}")
    if args.output != "-" and Path(args.output).exists() and not args.force:
        raise ConfigError(f"--output {args.output} exists; choose another name, or --force to replace it")
    libraries = _as_a_worker()  # (before `resolve`: it reads every file of a checkpoint, once)
    source = resolve(args.model, args.step, args.ema)
    print(f"sampling from {source.describe()} ({libraries})", file=sys.stderr, flush=True)
    count = generate(source.path, args.input, args.output, params, args.backend, args.seed, args.chat_template,
                     args.max_model_len, progress=Progress(sys.stderr), prompt_key=args.prompt_key,
                     input_key=args.input_key, removed=source.removed)
    print(f"wrote {count} samples to {'standard output' if args.output == '-' else Path(args.output).absolute()}",
          file=sys.stderr)
    return 0


def cmd_chat(args) -> int:
    from toolkit.use.chat import chat, context_of
    from toolkit.use.sampler import Sampler, check_model
    from toolkit.use.source import resolve

    params = _sampling(args)
    libraries = _as_a_worker()
    source = resolve(args.model, args.step, args.ema)
    try:
        check_model(source.path)
        context = context_of(source.path, params, args.max_model_len)  # (before the engine loads)
        print(f"chatting with {source.describe()} ('clear' starts over, 'quit' or Ctrl-D ends; {libraries})",
              file=sys.stderr, flush=True)
        sampler = Sampler(source.path, args.backend, context, args.seed)
    except Exception:
        if (removed := source.removed()):  # (a live run's: it named a missing tokenizer, or vLLM's traceback)
            raise ConfigError(removed) from None
        raise
    try:
        chat(sampler, params)
    finally:
        sampler.close()
    return 0


def _run_section(config: Path) -> dict:
    """The `run:` section of a run's config.yaml as written, or {} where there is none (`evaluate` then
    names what is wrong with the file)."""
    import yaml

    try:
        run = (yaml.safe_load(config.read_text()) or {}).get("run")
    except (OSError, yaml.YAMLError, AttributeError):
        return {}
    return run if isinstance(run, dict) else {}


def cmd_eval(args) -> int:
    from toolkit.use.evaluate import evaluate

    steps = None
    if args.steps:
        try:
            steps = sorted({int(s) for s in args.steps.split(",")})
        except ValueError:
            raise ConfigError(f"--steps {args.steps!r}: expected step numbers separated by commas") from None
    args.max_model_len = None
    os.umask(0o077)  # (what it writes in the run directory is its owner's alone, as the run's own files)
    if args.poll_s <= 0:
        raise ConfigError(f"--poll-s {args.poll_s:g}: give a number of seconds above 0")
    params = _sampling(args)
    run = _run_section(Path(args.run_dir) / "config.yaml")
    from typing import get_args

    from toolkit.config.base import Allocator

    name = run.get("allocator") if run.get("allocator") in get_args(Allocator) else "auto"
    libraries = _as_a_worker(name, run.get("fast_mkl_on_amd") is not False)
    print(f"({libraries}, as the run's workers: run.allocator, run.fast_mkl_on_amd)", file=sys.stderr, flush=True)
    evaluate(args.run_dir, params, args.input, steps, args.name, args.ema, args.backend, args.seed,
             follow_s=args.poll_s if args.follow else None)
    return 0


def cmd_report(args) -> int:
    from toolkit.report.page import write_report

    steps = None
    if args.samples_at:
        try:
            steps = [int(s) for s in args.samples_at.split(",")]
        except ValueError:
            raise ConfigError(f"--samples-at {args.samples_at!r}: expected step numbers separated by commas") from None
    if args.last_steps < 1:
        raise ConfigError("--last-steps must be at least 1")
    os.umask(0o077)  # (samples and the config: for the run's owner, also in an --out folder that exists)
    print(f"wrote {write_report(args.run_dir, args.out, steps, args.last_steps, args.force).absolute()}")
    return 0


def cmd_init(args) -> int:
    from toolkit.config.starter import write_starter

    for line in write_starter(args.model, args.out, args.cluster, args.prompts, args.reward_model, args.algorithm,
                              args.force):
        print(line)
    return 0


def cmd_tiny(args) -> int:
    from toolkit.tiny import build_tiny

    out = build_tiny(args.out_dir, args.seed)
    print(f"tiny model set in {Path(out).absolute()}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    wait_passively()  # (before any command imports torch; the workers a run starts inherit it)
    handler = {"run": cmd_run, "sft": lambda a: cmd_run(a, "sft"), "rm": lambda a: cmd_run(a, "rm"),
               "resume": cmd_resume, "inspect": cmd_inspect, "submit": cmd_submit, "render": cmd_render,
               "status": cmd_status, "cancel": cmd_cancel, "validate": cmd_validate, "plan": cmd_plan,
               "tiny": cmd_tiny, "export": cmd_export, "generate": cmd_generate, "eval": cmd_eval, "chat": cmd_chat,
               "report": cmd_report, "init": cmd_init}[args.command]
    return run_command(lambda: handler(args))


if __name__ == "__main__":
    sys.exit(main())
