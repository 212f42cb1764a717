"""Model checkpoints: every DeepSpeed engine (weights and optimizer state), the actor in Hugging Face format
for use elsewhere, and the trainer's own state (policy_version, KL controller, random generators).

    checkpoints/step-NNNNNN/actor/ds/...          DeepSpeed save_checkpoint (every rank writes its shard)
    checkpoints/step-NNNNNN/critic/ds/...         PPO only
    checkpoints/step-NNNNNN/hf/                   save_pretrained of the actor, and its tokenizer
    checkpoints/step-NNNNNN/trainer_state.json

Everything is written under a temporary name; rank 0 checksums every file, renames the directory into
place and only then records it in the manifest, so a checkpoint in the manifest is always complete.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
from pathlib import Path

import torch

from toolkit.store.experience import fsync_dir
from toolkit.store.manifest import Manifest, checkpoint_files

TAG = "ds"


def directory_of(run_dir: Path, version: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"step-{version:06d}"


def rng_state(generator: torch.Generator | None = None) -> str:
    state = generator.get_state() if generator is not None else torch.get_rng_state()
    return base64.b64encode(state.numpy().tobytes()).decode()


def set_rng_state(encoded: str, generator: torch.Generator | None = None) -> None:
    state = torch.frombuffer(bytearray(base64.b64decode(encoded)), dtype=torch.uint8)
    if generator is not None:
        generator.set_state(state)
    else:
        torch.set_rng_state(state)


def save(run_dir: Path, version: int, engines: dict, state: dict, tokenizer_path: str, rank: int, zero3: bool,
         barrier, keep: int) -> float:
    """Save a checkpoint of policy_version `version` (every trainer rank calls this); return its size in MB."""
    final = directory_of(run_dir, version)
    tmp = final.parent / f".{final.name}.tmp"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier()
    for name, engine in engines.items():
        engine.save_checkpoint(str(tmp / name), tag=TAG)
    _save_hf(engines["actor"], tmp / "hf", tokenizer_path, rank, zero3)
    barrier()
    size_mb = 0.0
    if rank == 0:
        (tmp / "trainer_state.json").write_text(json.dumps(state))
        for path in tmp.rglob("*"):
            if path.is_file():
                with open(path, "rb") as f:
                    os.fsync(f.fileno())
        files = checkpoint_files(tmp)
        size_mb = sum(size for _, size in files.values()) / 2**20
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        fsync_dir(final.parent)
        manifest = Manifest(run_dir)
        manifest.append({"kind": "checkpoint", "step": version, "dir": str(final.relative_to(run_dir)),
                         "files": files})
        _remove_old(run_dir, manifest, keep)
    barrier()
    return size_mb


def load(directory: Path, engines: dict) -> dict:
    """Load the engines' weights and optimizer states; return the trainer state saved with them."""
    for name, engine in engines.items():
        path, _ = engine.load_checkpoint(str(directory / name), tag=TAG, load_optimizer_states=True,
                                         load_lr_scheduler_states=True)
        if path is None:
            raise RuntimeError(f"DeepSpeed could not load the {name} checkpoint in {directory / name}")
    return json.loads((directory / "trainer_state.json").read_text())


def _save_hf(actor, directory: Path, tokenizer_path: str, rank: int, zero3: bool) -> None:
    """The actor as a Hugging Face model (full weights: gathered from every rank under ZeRO-3)."""
    from transformers import AutoTokenizer

    def write():
        if rank == 0:
            actor.module.save_pretrained(directory, safe_serialization=True)
            AutoTokenizer.from_pretrained(tokenizer_path).save_pretrained(directory)

    if zero3:
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(actor.module.parameters()), modifier_rank=None):
            write()
    else:
        write()


def _remove_old(run_dir: Path, manifest: Manifest, keep: int) -> None:
    """Keep the newest `keep` checkpoints (experience is never removed)."""
    records = manifest.records()
    removed = {r["dir"] for r in records if r["kind"] == "removed"}
    live = {r["dir"]: r for r in records if r["kind"] == "checkpoint" and r["dir"] not in removed}
    for record in sorted(live.values(), key=lambda r: r["step"])[:-keep]:
        shutil.rmtree(Path(run_dir) / record["dir"], ignore_errors=True)
        manifest.append({"kind": "removed", "dir": record["dir"]})
