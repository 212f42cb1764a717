"""The `slurm-rlhf` command. Parses arguments first and imports heavy modules only in the chosen command,
so `--help` is instant."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from toolkit.errors import ToolkitError

EXAMPLES = """examples:
  slurm-rlhf run templates/examples/tiny-grpo.yaml --run-dir runs/demo
  slurm-rlhf run run.yaml --set rollout.group_size=8 --set trainer.lr=1e-6
  slurm-rlhf validate run.yaml
  slurm-rlhf tiny models/tiny
"""


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="run config (YAML)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value, e.g. --set rollout.group_size=8 (repeatable)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="slurm-rlhf", description="Slurm-native RLHF (PPO, GRPO) without Ray.",
                                     epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__import__('toolkit').__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("run", help="run an RL job on this machine (workers as local processes)")
    _add_config_args(p)
    p.add_argument("--run-dir", help="directory for config, logs, metrics (default: runs/<run.name>)")
    p.add_argument("--verbose", "-v", action="store_true", help="show worker registration and debug records")

    p = sub.add_parser("validate", help="check a config and print it resolved (paths, defaults)")
    _add_config_args(p)

    p = sub.add_parser("tiny", help="build a tiny Llama, tokenizer, reward model and prompts offline")
    p.add_argument("out_dir", help="directory to write (model/, reward_model/, prompts.jsonl)")
    p.add_argument("--seed", type=int, default=0)
    return parser


def cmd_run(args) -> int:
    import logging

    from toolkit.config import load_config
    from toolkit.data.prompts import read_prompts
    from toolkit.launch.driver import Driver
    from toolkit.launch.local import LocalLauncher
    from toolkit.launch.rundir import RunDir
    from toolkit.log import setup_logging

    cfg = load_config(args.config, args.overrides)
    read_prompts(cfg.data.prompts, cfg.data.prompt_key)  # bad data is a config error, found before any process
    run_dir = RunDir(args.run_dir or Path("runs") / cfg.run.name).create(cfg)
    setup_logging("driver", level=logging.DEBUG if args.verbose else logging.WARNING,
                  file=str(run_dir.logs / "driver.log"))
    print(f"run {cfg.run.name!r} ({cfg.run.algorithm}, {cfg.run.steps} steps) in {run_dir.path}", flush=True)
    started = time.monotonic()
    driver = Driver(cfg, run_dir, LocalLauncher(run_dir), bind_host=cfg.transport.bind_host or "127.0.0.1",
                    echo=lambda line: print(line, flush=True))
    records = driver.run()
    first, last = records[: min(5, len(records))], records[-min(5, len(records)):]
    mean = lambda rs: sum(r["reward_mean"] for r in rs) / len(rs)  # noqa: E731
    print(f"done in {time.monotonic() - started:.1f} s: {len(records)} steps, mean reward of the first "
          f"{len(first)} steps {mean(first):.3f}, of the last {len(last)} steps {mean(last):.3f}; "
          f"metrics in {run_dir.metrics}", flush=True)
    return 0


def cmd_validate(args) -> int:
    from toolkit.config import dump_config, load_config

    cfg = load_config(args.config, args.overrides)
    print(dump_config(cfg), end="")
    return 0


def cmd_tiny(args) -> int:
    from toolkit.tiny import build_tiny

    out = build_tiny(args.out_dir, args.seed)
    print(f"tiny model set in {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    handler = {"run": cmd_run, "validate": cmd_validate, "tiny": cmd_tiny}[args.command]
    try:
        return handler(args)
    except ToolkitError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return e.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
