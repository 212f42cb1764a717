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
from toolkit.store.durable import settle
from toolkit.use.source import checkpoints, resolve


def export(run_dir: str, out: str, step: int | None = None, ema: bool = False) -> Path:
    source = resolve(run_dir, step, ema)
    if source.run_dir is None:
        raise ConfigError(f"{run_dir} is a model directory already; export copies a run's checkpoint")
    check_new(Path(out), out, "export")
    # (name: size) of each file of the copy, as the manifest recorded them: a live run removes its older
    # checkpoints (checkpoint.keep), and one removed while it was copied ended the export in shutil's traceback
    record = checkpoints(source.run_dir).get(source.step, {"files": {}})
    sizes = {rel.split("/", 1)[1]: size for rel, (_, size) in record["files"].items()
             if rel.split("/")[0] == source.path.name}

    def build(tmp: Path) -> None:
        try:
            shutil.copytree(source.path, tmp, dirs_exist_ok=True)
        except OSError:
            if source.step in checkpoints(source.run_dir):
                raise
        if not sizes or any(not (tmp / rel).is_file() or (tmp / rel).stat().st_size != size
                            for rel, size in sizes.items()):
            has = ", ".join(map(str, sorted(checkpoints(source.run_dir)))) or "none now"
            raise ConfigError(f"{run_dir}: checkpoint step {source.step} was removed while it was copied (the run "
                              f"keeps its newest checkpoint.keep); export a step it has now ({has}), or the newest "
                              "(no --step)")
        origin = tmp / "slurm_rlhf.json"
        origin.write_text(json.dumps({"run_dir": str(source.run_dir), "step": source.step, "ema": ema,
                                      "lora_merged": (tmp / "adapter").is_dir()}, indent=1) + "\n")
        origin.chmod(0o600)  # (as the weights copied beside it: the run's files are their owner's alone)
        settle(tmp)  # (on disk before it is named: a rename alone does not order the files' data before it)

    return build_beside(out, build)
