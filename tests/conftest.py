"""Shared fixtures: the tiny model set (built offline once), config writing, CLI runs, process checks."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
# DeepSpeed's compiled ops: the cache tools/setup.sh fills (workers use it too).
os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "torch_extensions"))
EXAMPLES = REPO / "templates" / "examples"


@pytest.fixture(scope="session")
def tiny() -> Path:
    """models/tiny: tiny Llama, tokenizer, reward model and prompts (seeded, built once)."""
    from toolkit.tiny import build_tiny

    return build_tiny(REPO / "models" / "tiny")


def write_config(directory: Path, data: dict, name: str = "run.yaml") -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / name
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def example(name: str, tiny: Path, **sections) -> dict:
    """An example config with absolute paths to the tiny set, sections overridden (merged one level deep)."""
    data = yaml.safe_load((EXAMPLES / name).read_text())
    data["data"]["prompts"] = str(tiny / "prompts.jsonl")
    data["model"]["actor"] = str(tiny / "model")
    for rm in data.get("reward", {}).get("models", []):
        rm["path"] = str(tiny / "reward_model")
    for key, value in sections.items():
        if isinstance(value, dict) and isinstance(data.get(key), dict):
            data[key] = {**data[key], **value}
        else:
            data[key] = value
    return data


def cli(*args, timeout: float = 600, env: dict | None = None, **kwargs) -> subprocess.CompletedProcess:
    """Run `slurm-rlhf ARGS` as a user would; returns the completed process (text output)."""
    return subprocess.run([sys.executable, "-m", "toolkit", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, cwd=kwargs.pop("cwd", REPO), env={**os.environ, **(env or {})}, **kwargs)


def alive(pids) -> list[int]:
    """Those of `pids` that are still running (zombies count as gone)."""
    import psutil

    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.NoSuchProcess:
            pass
    return out
