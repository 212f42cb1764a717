"""`slurm-rlhf export RUN_DIR [--step N] [--ema] OUT`: a checkpoint as a Hugging Face model directory.

The checkpoint's `hf/` copy (or `hf-ema/`) is verified against the manifest's checksums and copied to
OUT under a temporary name, then renamed into place: OUT is whole or absent. A model trained with LoRA is
there already merged (a plain model), with its adapters alone in OUT/adapter/. OUT/slurm_rlhf.json says
where it came from.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from toolkit.errors import ConfigError
from toolkit.newdir import build_beside, check_new
from toolkit.use.source import resolve


def export(run_dir: str, out: str, step: int | None = None, ema: bool = False) -> Path:
    source = resolve(run_dir, step, ema)
    if source.run_dir is None:
        raise ConfigError(f"{run_dir} is a model directory already; export copies a run's checkpoint")
    check_new(Path(out), out, "export")

    def build(tmp: Path) -> None:
        shutil.copytree(source.path, tmp, dirs_exist_ok=True)
        origin = tmp / "slurm_rlhf.json"
        origin.write_text(json.dumps({"run_dir": str(source.run_dir), "step": source.step, "ema": ema,
                                      "lora_merged": (tmp / "adapter").is_dir()}, indent=1) + "\n")
        origin.chmod(0o600)  # (as the weights copied beside it: the run's files are their owner's alone)

    return build_beside(out, build)
