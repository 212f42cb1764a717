"""Which model a `generate`, `chat` or `export` command means: a run directory's checkpoint, or any
Hugging Face model directory.

A run directory names its newest checkpoint (or `--step N`); `--ema` picks the checkpoint's EMA copy.
Every file of the chosen copy is checked against the checksums that the run manifest recorded when the
checkpoint was written, so a damaged copy is named instead of loaded.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from toolkit.errors import ConfigError


NO_CHECKPOINT = "the run has no checkpoint yet (checkpoint.every_steps sets how often one is written)"


@dataclass
class ModelSource:
    path: Path                  # a Hugging Face model directory (weights, config.json, tokenizer)
    run_dir: Path | None = None  # the run it came from, if any
    step: int | None = None      # the checkpoint's step (an RL run: its policy version)
    ema: bool = False

    def describe(self) -> str:
        if self.run_dir is None:
            return str(self.path)
        return f"{self.run_dir} step {self.step}{' (EMA)' if self.ema else ''}"

    def removed(self) -> str | None:
        """Where the run removed this checkpoint since it was resolved (a live run keeps its newest
        checkpoint.keep): what to say, naming the steps it has now; else None."""
        if self.run_dir is None or (self.step in checkpoints(self.run_dir) and self.path.is_dir()):
            return None
        has = ", ".join(map(str, sorted(checkpoints(self.run_dir)))) or "none now"
        return (f"{self.run_dir}: checkpoint step {self.step} was removed by the run before it was read (it keeps its "
                f"newest checkpoint.keep); choose a step it has now ({has}), or the newest (no --step)")


def checkpoints(run_dir: Path) -> dict[int, dict]:
    """{step: manifest record} of the checkpoints a run still has."""
    from toolkit.store.manifest import Manifest, live_checkpoints

    return live_checkpoints(Manifest(run_dir).records())


def resolve(name: str, step: int | None = None, ema: bool = False, step_flag: str = "--step") -> ModelSource:
    """The model that `name` (a run directory or a model directory) means; ConfigError if there is none.
    `step_flag`: the command's option that picks checkpoints (eval's is --steps), named where one is damaged."""
    from toolkit.launch.pipeline import refuse_pipeline_dir
    from toolkit.store.manifest import verify

    path = Path(name)
    if not path.is_dir():
        raise ConfigError(f"{name}: no such directory; give a run directory (runs/NAME) or a Hugging Face "
                          "model directory (with config.json)")
    refuse_pipeline_dir(path, "name")
    if not (path / "config.yaml").exists():
        if (step is not None or ema):
            raise ConfigError(f"{name} is not a run directory (no config.yaml): --step and --ema pick a "
                              "checkpoint of a run")
        if not (path / "config.json").exists():
            raise ConfigError(f"{name} is neither a run directory (config.yaml) nor a Hugging Face model "
                              "directory (config.json)")
        return ModelSource(path.resolve())
    found = checkpoints(path)
    if not found:
        raise ConfigError(f"{name}: {NO_CHECKPOINT}")
    if step is None:
        step = max(found)
    elif step not in found:
        raise ConfigError(f"{name}: no checkpoint at step {step}; it has steps {', '.join(map(str, sorted(found)))}")
    record = found[step]
    copy = "hf-ema" if ema else "hf"
    files = {rel: entry for rel, entry in record["files"].items() if rel.split("/")[0] == copy}
    if not files:
        why = "the run has no EMA (trainer.ema)" if ema else "it has no Hugging Face copy"
        raise ConfigError(f"{name}: checkpoint {record['dir']} has no {copy}/: {why}")
    for rel, (digest, size) in files.items():
        if (problem := verify(path / record["dir"] / rel, digest, size)):
            raise ConfigError(f"{path / record['dir'] / rel}: {problem}; choose another checkpoint with {step_flag} "
                              f"(this run has {', '.join(map(str, sorted(found)))})")
    return ModelSource((path / record["dir"] / copy).resolve(), path.resolve(), step, ema)
