"""Hugging Face copies of trained models: in each checkpoint (`hf/`), and the stage's product, the
run directory's `export/`, which the next stage of a pipeline reads.

Under ZeRO-3 the weights are gathered from every rank first, so every rank calls `save_hf`; rank 0 writes.
An export is written under a temporary name and renamed into place, so `export/` is always whole.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path


def save_hf(module, directory: Path, tokenizer_path: str, rank: int, zero3: bool, state_dict: dict | None = None,
            extra_files: dict[str, dict] | None = None) -> None:
    """`module` (or the given full `state_dict` for it) as a Hugging Face model directory with the tokenizer
    and `extra_files` ({file name: JSON content}). A model with LoRA adapters is written merged (a plain
    model), its adapters alone beside it in `adapter/`."""
    from transformers import AutoTokenizer

    from toolkit.training.lora import has_adapters, merged_state_dict, plain_model

    def write():
        if rank != 0:
            return
        target, state = module, state_dict
        if has_adapters(module):
            if state is None:
                module.save_pretrained(Path(directory) / "adapter", safe_serialization=True)
                state = merged_state_dict(module)
            target = plain_model(module)
        target.save_pretrained(directory, state_dict=state, safe_serialization=True)
        AutoTokenizer.from_pretrained(tokenizer_path).save_pretrained(directory)
        for name, content in (extra_files or {}).items():
            (Path(directory) / name).write_text(json.dumps(content, indent=1))

    if zero3 and state_dict is None:
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
            write()
    else:
        write()


def exported(run_dir: Path, step: int) -> bool:
    """Whether RUN_DIR/export holds the model of `step`: the manifest's last export record (written after
    the copies) is of that step. A run killed between its last checkpoint and the export had none, or the
    one of an earlier end (before run.steps was raised), and its resume, with nothing to train, ended as
    finished without one."""
    from toolkit.store.manifest import Manifest

    last = Manifest(run_dir).last("export")
    return last is not None and last["step"] == step and (Path(run_dir) / "export").is_dir()


def publish(run_dir: Path, source: Path, name: str = "export") -> Path:
    """Copy a checkpoint's Hugging Face directory `source` to RUN_DIR/<name> (atomically, on disk before
    it is named; rank 0). A full disk is a DiskFull naming it, and the partial copy is removed."""
    from toolkit.store import space
    from toolkit.store.durable import put_in_place, settle

    final = Path(run_dir) / name
    tmp = final.parent / f".{name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    with space.named_if_full(name, final, run_dir, lambda: shutil.rmtree(tmp, ignore_errors=True)):
        shutil.copytree(source, tmp)
        settle(tmp)
        put_in_place(tmp, final)
    return final


def withdraw(run_dir: Path, name: str) -> None:
    """Remove RUN_DIR/<name> (an export no longer of the run's end), renamed aside first: it is there whole or
    gone, never half removed under its name."""
    from toolkit.store.experience import fsync_dir

    final = Path(run_dir) / name
    aside = final.parent / f".{name}.old-{os.getpid()}"
    os.replace(final, aside)
    fsync_dir(final.parent)
    shutil.rmtree(aside, ignore_errors=True)
